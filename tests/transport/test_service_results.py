"""What rollout workers post, through the real service to the real Coordinator (fake workers on
the real protocol, tests/transport/remote_fakes.py): a forged result (an unknown, finished or other
slice's trajectory, a swapped group, a trajectory that does not decode, a post out of sequence)
fails the slice that posted it and nothing else; the slice joins again and the run trains on with
a clean audit. Sessions stay bounded however often roles register."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

import dora_jax
from dora_jax.coordinator.audit import audit
from dora_jax.transport import codec
from dora_jax.transport import dora_pb2 as pb
from dora_jax.transport.client import CallFailed, Refused
from dora_jax.transport.service import PROTOCOL, CoordinatorService, Identity
from tests.coordinator.test_intake import _result
from tests.transport.remote_fakes import HASH, TIMING, RemoteRun, connect, serve


def _until(predicate, run, what, timeout_s=60.0):
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert not run.loop_error, run.loop_error
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _events(run, kind):
    return [e for e in list(run.ledger.memory) if e["ev"] == kind]


def _forge_and_expect(run, post, reason: str, *, or_finished: str = "") -> None:
    """Posts as slice 0 (its session, next seq) and waits until slice 0 has failed for `reason` and
    joined again. `or_finished`: the trajectory the post names may finish on its slice before the
    post arrives (the workers run meanwhile); then it is refused as no longer in flight."""
    failures, joins = len(_events(run, "slice_failed")), len(_events(run, "slice_joined"))
    try:
        post()
    except (CallFailed, grpc.RpcError):
        pass  # refused at the service: the slice fails there
    _until(lambda: len(_events(run, "slice_failed")) > failures, run, f"slice 0 to fail for {reason}")
    failed = _events(run, "slice_failed")[failures]
    finished = bool(or_finished) and f"{or_finished!r} is not in flight" in failed["reason"]
    assert failed["slice"] == 0 and (reason in failed["reason"] or finished), failed
    _until(lambda: len(_events(run, "slice_joined")) > joins, run, "slice 0 to join again")


def _wait_for_work(run, slice_id):
    _until(lambda: run.in_flight(slice_id), run, f"requests on slice {slice_id}")
    return run.in_flight(slice_id)


def test_forged_results_over_grpc_fail_only_the_slice_that_posted_them():
    run = RemoteRun(slices=2)
    fake = run.fakes[0]
    try:
        run.train_to(2)
        proto = codec.trajectory_to_proto
        done = _events(run, "finish")[0]["traj"]
        with run.training():  # the run goes on: slice 0 gets work again after each rejoin
            request = _wait_for_work(run, 0)[0]
            unknown = dataclasses.replace(request, traj_id="g999999/0")
            _forge_and_expect(run, lambda: fake.post([proto(_result(unknown))]), "'g999999/0' is not in flight")
            duplicate = dataclasses.replace(_wait_for_work(run, 0)[0], traj_id=done)
            _forge_and_expect(run, lambda: fake.post([proto(_result(duplicate))]), f"'{done}' is not in flight")
            theirs = _wait_for_work(run, 1)[0]
            _forge_and_expect(
                run,
                lambda: fake.post([proto(_result(theirs))]),
                f"'{theirs.traj_id}' was dispatched to slice 1",
                or_finished=theirs.traj_id,
            )
            mine = _wait_for_work(run, 0)[0]
            other = next(g for g in list(run.coord.groups) if g != mine.group_id)
            swapped = proto(_result(mine, group_id=other))
            _forge_and_expect(
                run,
                lambda: fake.post([swapped]),
                f"group_id='{other}' but it was dispatched with",
                or_finished=mine.traj_id,
            )
            garbled = proto(_result(_wait_for_work(run, 0)[0]))
            garbled.finish_reason = "exploded"
            _forge_and_expect(run, lambda: fake.post([garbled]), "posted a trajectory that does not decode")
            _wait_for_work(run, 0)
            _forge_and_expect(run, lambda: fake.post([], seq=fake._seq + 5), "out of sequence")
        run.train_to(run.version + 6)  # on, after the last refusal
        report = audit(run.ledger.memory)
        assert report.ok and report.consumed == run.version * 8, report.summary()
        assert run.coord.stats.result_violations == 4  # the last two were refused by the service itself
        assert run.fakes[1].rejoins == 0 and {e["slice"] for e in _events(run, "slice_failed")} == {0}
        # A failure the service finds itself (the last two) is posted to the coordinator; the worker
        # may join again before the coordinator drops the slice, and that drop, answering the
        # failure, leaves the new session alone (CoordinatorService.slice_dropped): one rejoin and
        # one slice_failed per forgery, no more.
        reasons = [e["reason"] for e in _events(run, "slice_failed")]
        assert len(reasons) == run.coord.stats.slice_failures == fake.rejoins == 6, (
            reasons,
            fake.rejoin_causes,
        )
        assert len([e for e in _events(run, "finish") if e["traj"] == theirs.traj_id]) == 1  # its own result
        consumed = sorted(e["traj"] for e in _events(run, "consume") if e["group"] == other)
        assert consumed == [f"{other}/{i}" for i in range(4)]  # whole, with its own samples, trained on
        assert not run.loop_error
    finally:
        run.close()


def _register(client, role, *, slice_id=-1, host_id=0, config_hash=HASH):
    request = pb.RegisterRequest(
        role=role,
        slice_id=slice_id,
        num_slots=4,
        config_hash=config_hash,
        package_version=dora_jax.__version__,
        protocol=PROTOCOL,
        host="test",
        host_id=host_id,
    )
    return client.stub.Register(request, timeout=10)


def test_sessions_stay_bounded_however_often_roles_register():
    """A trainer registering again replaces its session; a rollout worker registering again for a
    slice whose stream never opened replaces that one; trainer host ids beyond the configured
    hosts are refused: 100 registrations leave one session per slice and one trainer's."""
    service = CoordinatorService(Identity(HASH, dora_jax.__version__, 2, 4), TIMING, log=lambda m: None)
    server, address = serve(service)
    client = connect(address)
    try:
        for i in range(50):
            _register(client, pb.TRAINER)
            _register(client, pb.ROLLOUT, slice_id=i % 2)
        assert len(service._sessions) == 3 and len(service._trainers) == 1 and sorted(service.ports) == [0, 1]
        with pytest.raises(grpc.RpcError) as refused:
            _register(client, pb.TRAINER, host_id=1)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert refused.value.details() == "trainer host_id=1; expected 0..0"
        with pytest.raises(Refused, match="config hash"):
            client.register(pb.TRAINER, "0" * 64)
        assert len(service._sessions) == 3
    finally:
        client.close()
        server.stop(0)


def test_take_batch_with_peek_shows_finished_samples_once_each_groups_still_decoding_included():
    """trainer.score_ahead over gRPC: a not-ready TakeBatch with `peek` returns finished samples
    the trainer will train on, a group still decoding showing those it has finished; it takes
    nothing; no sample is shown twice, in this take or the next; the batch holds samples shown."""
    run = RemoteRun(slices=1, slots=4, tbs=8, g=4)  # one slice: the groups of 4 finish one by one
    try:
        session = run.trainer.session
        shown: set[str] = set()
        partial = False
        for version in (0, 1):
            ask = lambda v=version: run.trainer.stub.TakeBatch(  # noqa: E731
                pb.TakeBatchRequest(session=session, trainer_version=v, wait_s=5.0, peek=True), timeout=10
            )
            consumed = len(_events(run, "consume"))
            reply = ask()
            while not reply.ready:
                assert reply.groups, reply
                for group in reply.groups:
                    ids = {s.trajectory.traj_id for s in group.samples}
                    assert ids and not ids & shown, (ids, shown)  # each sample once
                    assert {i.rsplit("/", 1)[0] for i in ids} == {group.group_id}
                    partial |= len(ids) < 4
                    shown |= ids
                assert len(_events(run, "consume")) == consumed  # a peek takes nothing
                reply = ask()
            batch = {s.trajectory.traj_id for g in reply.groups for s in g.samples}
            assert len(reply.groups) == 2 and len(batch) == 8 and batch & shown, (batch, shown)
            run.trainer.stub.ReportPublished(pb.PublishedRequest(session=session, version=version + 1), timeout=10)
        assert partial  # a group still decoding showed the samples it had finished
    finally:
        run.close()
