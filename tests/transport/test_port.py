"""GrpcRolloutPort against a real gRPC server and real RolloutWorkers (tiny model): a request
exported from one remote worker and imported into another continues bit-exactly; a worker whose
stream breaks fails its port and the coordinator is told; bad registrations are refused; an
unreachable coordinator is a clear error after the deadline."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest

import dora_jax
from dora_jax.coordinator.ports import PortError
from dora_jax.core.records import Request, SamplingParams, SlotState
from dora_jax.rollout.worker import RolloutWorker
from dora_jax.store import ParamStore, TensorStoreTier
from dora_jax.transport import dora_pb2 as pb
from dora_jax.transport.client import Client, ClientTiming, CoordinatorUnreachable, Refused
from dora_jax.transport.kv_transfer import KVTransfer
from dora_jax.transport.rollout_agent import RolloutAgent, fetch_from_store
from dora_jax.transport.service import PROTOCOL, CoordinatorService, Identity, Timing, make_server
from tests.rollout.conftest import run_to_end
from tests.transport.conftest import Sink

HASH = "c0ffee" * 10
SAMPLINGS = [
    SamplingParams(temperature=1.0, seed=11),
    SamplingParams(temperature=1.0, top_p=0.9, seed=12),
    SamplingParams(temperature=0.8, top_k=10, seed=13),
    SamplingParams(temperature=0.0),
]


def _requests():
    return [Request(f"m{i}", "g", f"p{i}", tuple(range(1 + i, 6 + 3 * i)), 0, 40, s) for i, s in enumerate(SAMPLINGS)]


def _until(predicate, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _serve(num_slices=2, **timing):
    service = CoordinatorService(
        Identity(HASH, dora_jax.__version__, num_slices, 4),
        Timing(heartbeat_period_s=0.05, **timing),
        log=lambda m: None,
    )
    server, port = make_server(service, 0, host="127.0.0.1")
    return service, server, f"127.0.0.1:{port}"


def _slowed(worker, seconds):
    """Paces a worker's decode loop so a test can act mid-generation (results do not change)."""
    step = worker.step

    def slow_step():
        time.sleep(seconds)
        return step()

    worker.step = slow_step
    return worker


@pytest.mark.slow
@pytest.mark.parametrize(
    "direct,pullable,engines",
    [
        (False, True, "two_engines"),
        (True, True, "two_engines"),
        (True, False, "two_engines"),
        (False, True, "two_bf16_engines"),
    ],
    ids=["kv_inline", "kv_transfer_server", "no_pull", "kv_inline_bf16"],
)
def test_remote_migration_equals_unmigrated(request, tiny_params, tmp_path, direct, pullable, engines):
    """The KV rows through the coordinator's stream, or (`direct`) pulled by the destination from
    the source's transfer server, the coordinator carrying a ticket: the same tokens either way.
    A destination that cannot pull them (`pullable=False`: it has no transfer server) re-prefills
    them and says which in its import's result (the coordinator's ledger writes `how: reprefill`).
    `kv_inline_bf16`: bfloat16 KV rows (every real config's) framed as raw bytes on the stream."""
    two_engines = request.getfixturevalue(engines)
    reference = RolloutWorker(two_engines[0], slice_id=0, eos_ids=())
    reference.load_version(0, tiny_params)
    for request in _requests():
        reference.submit(request)
    expected = run_to_end(reference)

    ParamStore(TensorStoreTier(tmp_path / "versions")).publish(0, tiny_params)
    reader = ParamStore(TensorStoreTier(tmp_path / "versions", read_only=True))
    service, server, address = _serve()
    sink = Sink()
    service.attach(sink)
    agents, threads, outcomes = [], [], {}
    for sid, engine in enumerate(two_engines):
        worker = _slowed(RolloutWorker(engine, slice_id=sid, eos_ids=()), 0.02 if sid == 0 else 0.0)
        agent = RolloutAgent(
            Client(address),
            worker,
            fetch_from_store(reader, engine.param_shardings),
            HASH,
            kv_transfer=KVTransfer(engine, host="127.0.0.1") if direct and (pullable or sid == 0) else None,
            log=lambda m: None,
        )
        agent.register()
        agents.append(agent)
        threads.append(threading.Thread(target=lambda a=agent, s=sid: outcomes.setdefault(s, a.run()), daemon=True))
        threads[-1].start()
    try:
        _until(lambda: len(sink.joined) == 2, what="both command streams")
        source, destination = service.ports[0], service.ports[1]
        source.load_version(0)
        destination.load_version(0)
        source.submit(_requests())
        _until(lambda: service.worker_counters().get("generated_tokens", 0) >= 12, what="tokens on slice 0")
        progress = source.progress()  # what a checkpoint keeps; the slice goes on untouched
        assert sorted(progress) == [r.traj_id for r in _requests()]
        assert all(
            len(r.prefix_response_ids) == len(r.prefix_logprobs) == len(r.prefix_versions) >= 1
            and set(r.prefix_versions) == {0}
            for r in progress.values()
        )
        items = source.export([r.traj_id for r in _requests()])
        assert len(items) == 4 and all(isinstance(i, SlotState) for i in items), items
        assert all(1 <= len(i.response_ids) < 40 for i in items)  # mid-generation
        assert all(len(i.response_ids) >= len(progress[i.request.traj_id].prefix_response_ids) for i in items)
        if direct:  # the rows' shapes (padded to their bucket) and where to pull them from
            assert all(i.kv_ticket.address == agents[0].kv_transfer.address for i in items)
            assert all(i.k_LSKD.shape[1] == two_engines[0].config.rows_bucket(i.position) for i in items)
        else:
            assert all(i.kv_ticket is None and i.k_LSKD.shape[1] == i.position for i in items)
            assert all(i.k_LSKD.dtype == two_engines[0].model_config.dtype for i in items)
        reprefilled = destination.import_(items[::-1])
        assert reprefilled == ([] if pullable else [i.request.traj_id for i in items[::-1]])
        _until(lambda: len(sink.finished) == 4, what="the migrated requests to finish")
    finally:
        service.stop("test over")
        for thread in threads:
            thread.join(timeout=30)
        server.stop(0)
    assert outcomes == {0: "stopped: test over", 1: "stopped: test over"}
    for traj_id, ref in expected.items():
        slice_id, moved = sink.finished[traj_id]
        assert slice_id == 1 and moved.versions_seen == (0,)
        assert moved.num_migrations == (1 if pullable else 0)  # it counts moves of KV rows
        assert moved.response_ids == ref.response_ids, traj_id
        if not pullable:  # re-prefilled: the prefix's log-probs are carried, the rest recomputed by a prefill
            assert moved.logprobs == pytest.approx(ref.logprobs, abs=1e-5), traj_id
            continue
        assert moved.logprobs == ref.logprobs, traj_id  # bit-exact across processes' wire format
    if not pullable:
        assert agents[1].worker.counters.prefills >= 4
        return
    assert agents[1].worker.counters.prefills == 0 and agents[1].worker.counters.imports == 4
    if direct:
        assert agents[1].kv_transfer.failures == 0 and agents[1].kv_transfer.pulled_bytes > 0
    assert sink.failed == []  # stopped ports are not failures


def test_broken_stream_fails_the_port_and_tells_the_coordinator():
    service, server, address = _serve(num_slices=1)
    sink = Sink()
    service.attach(sink)
    client = Client(address)
    session = client.register(pb.ROLLOUT, HASH, slice_id=0, num_slots=4).session
    stream = client.stub.Commands(pb.CommandsRequest(session=session))
    try:
        _until(lambda: sink.joined == [0], what="the stream to open")
        port = service.ports[0]
        stream.cancel()  # the worker process is gone
        _until(lambda: sink.failed, what="the failure")
        assert sink.failed == [(0, "command stream closed")]
        with pytest.raises(PortError, match="slice 0 is gone"):
            port.submit(_requests())
        with pytest.raises(Exception, match="not live"):  # its session is over: a late post is refused
            client.call("Heartbeat", lambda t: client.stub.Heartbeat(pb.HeartbeatRequest(session=session), timeout=t))
        assert client.register(pb.ROLLOUT, HASH, slice_id=0, num_slots=4).session != session  # it may rejoin
    finally:
        server.stop(0)


def test_missed_heartbeats_and_unanswered_commands_fail_the_port():
    service, server, address = _serve(num_slices=1, heartbeat_timeout_s=0.5, command_timeout_s=0.3)
    sink = Sink()
    service.attach(sink)
    client = Client(address)
    session = client.register(pb.ROLLOUT, HASH, slice_id=0, num_slots=4).session
    stream = client.stub.Commands(pb.CommandsRequest(session=session))
    try:
        _until(lambda: sink.joined == [0], what="the stream to open")
        with pytest.raises(PortError, match="no result for load_version"):
            service.ports[0].load_version(0)  # nobody reads the stream, nobody answers
        assert sink.failed and "no result for load_version" in sink.failed[0][1]
        session = client.register(pb.ROLLOUT, HASH, slice_id=0, num_slots=4).session
        stream = client.stub.Commands(pb.CommandsRequest(session=session))
        _until(lambda: len(sink.failed) == 2, timeout=10, what="the heartbeat deadline")
        assert "no heartbeat for" in sink.failed[1][1]
    finally:
        stream.cancel()
        server.stop(0)


def test_a_dropped_slice_is_promised_back_until_the_rejoin_timeout():
    """The coordinator is told a dropped slice will join again (its worker registers again by
    itself, or its launcher restarts it): with every slice down the run waits. A worker that
    registers again within `rejoin_timeout_s` keeps the promise; one that does not is posted as
    `post_slice_wont_rejoin`, naming the timeout and why the slice was dropped."""
    service, server, address = _serve(num_slices=2, rejoin_timeout_s=0.6)
    sink = Sink()
    service.attach(sink)
    client = Client(address)
    streams = [
        client.stub.Commands(
            pb.CommandsRequest(session=client.register(pb.ROLLOUT, HASH, slice_id=sid, num_slots=4).session)
        )
        for sid in (0, 1)
    ]
    try:
        _until(lambda: sorted(sink.joined) == [0, 1], what="the streams to open")
        assert service.slice_dropped(0, "load_version failed") is True
        assert service.slice_dropped(1, "load_version failed") is True
        _until(lambda: len(sink.failed) == 2, what="both sessions to end")
        session = client.register(pb.ROLLOUT, HASH, slice_id=1, num_slots=4).session
        streams.append(client.stub.Commands(pb.CommandsRequest(session=session)))  # slice 1 comes back
        _until(lambda: sorted(sink.joined) == [0, 1, 1], what="slice 1 to join again")
        _until(lambda: sink.wont_rejoin, timeout=10, what="the rejoin deadline")
        time.sleep(1.0)  # slice 1's promise, kept, is never reported
        assert sink.wont_rejoin == [(0, "did not register again within rejoin_timeout_s=0.6s (load_version failed)")]
    finally:
        for stream in streams:
            stream.cancel()
        server.stop(0)


def test_registration_refusals_name_the_mismatch():
    service, server, address = _serve()
    client = Client(address)
    try:
        with pytest.raises(Refused, match="config hash 0123456789ab differs.*same --config"):
            client.register(pb.ROLLOUT, "0123456789ab" * 4, slice_id=0, num_slots=4)
        with pytest.raises(Refused, match=r"slice_id=2; expected 0..1 \(rollout.num_slices=2\)"):
            client.register(pb.ROLLOUT, HASH, slice_id=2, num_slots=4)
        with pytest.raises(Refused, match="num_slots=8; the config says rollout.slots=4"):
            client.register(pb.ROLLOUT, HASH, slice_id=0, num_slots=8)
        old = pb.RegisterRequest(role=pb.TRAINER, config_hash=HASH, package_version="0.0.1", protocol=PROTOCOL)
        with pytest.raises(grpc.RpcError) as err:
            client.stub.Register(old, timeout=5)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "package version '0.0.1' differs" in err.value.details()
        assert client.register(pb.TRAINER, HASH).session  # the right identity joins
    finally:
        server.stop(0)


def test_unreachable_coordinator_is_a_clear_error_after_the_deadline():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    client = Client(address, ClientTiming(call_timeout_s=0.3, unreachable_after_s=1.5, backoff_s=0.05))
    start = time.monotonic()
    with pytest.raises(CoordinatorUnreachable, match=f"coordinator at {address} unreachable for .* during Register"):
        client.register(pb.ROLLOUT, HASH, slice_id=0, num_slots=4)
    assert 1.5 <= time.monotonic() - start < 10
