"""A property-based fuzz of what rollout workers send (`PostFinished`, `Ack`, `Register`) and of the
trainer's `Evaluate` (any version, sample count, wait and session) against
the real CoordinatorService wrapping the real Coordinator, with fake workers on the real protocol
(tests/transport/remote_fakes.py) and a trainer training meanwhile.

Messages are valid, subtly wrong (one field of a real in-flight request's result changed) or
garbage, on a live worker's session or on none. Whatever arrives: the server answers every call
(an error status at worst), the coordinator's loop never dies, a refusal fails only the slice that
sent it (bounded, escaped reasons), the run trains on afterwards, and the full audit of the ledger
passes.

Left out on purpose: a valid trainer `Register` (it sends the run back to the trainer's checkpoint,
by design) and `Ack`s answering a command that is pending (the session id is the worker's secret:
only the worker itself could, and it would strand its own requests); arrays in `Ack` frames
(their dtypes are checked by the codec, not here).
"""

from __future__ import annotations

import math

import grpc
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import dora_jax
from dora_jax.coordinator.audit import audit
from dora_jax.core.records import FinishReason
from dora_jax.transport import codec
from dora_jax.transport import dora_pb2 as pb
from dora_jax.transport.client import CallFailed, Refused, SessionLost
from dora_jax.transport.service import PROTOCOL, HeldOut
from tests.coordinator.test_intake import _result
from tests.transport.remote_fakes import HASH, RemoteRun

INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.one_of(st.integers(-3, 40), st.integers(-(2**63), 2**63 - 1))
TEXT = st.one_of(st.text(max_size=20), st.text(alphabet="\n\r\x1b[]/g0123", max_size=4000))
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
REASONS = st.one_of(st.sampled_from([r.value for r in FinishReason]), TEXT)

MUTATIONS = {  # one field of a real result made wrong (None: the result as it is, valid)
    "none": st.none(),
    "group_id": TEXT.map(lambda v: {"group_id": v}),
    "prompt_id": TEXT.map(lambda v: {"prompt_id": v}),
    "version": INT64.map(lambda v: {"version": v}),
    "response_ids": st.lists(INT32, max_size=6).map(lambda v: {"response_ids": tuple(v)}),
    "logprobs": st.lists(FLOATS, min_size=3, max_size=3).map(lambda v: {"logprobs": tuple(v)}),
    "versions_seen": st.lists(INT64, max_size=4).map(lambda v: {"versions_seen": tuple(v)}),
    "decode_s": FLOATS.map(lambda v: {"decode_s": v}),
    "too_long": st.just({"response_ids": (1,) * 201, "logprobs": (-0.5,) * 201}),
}


@st.composite
def garbage_trajectory(draw) -> pb.Trajectory:
    return pb.Trajectory(
        traj_id=draw(TEXT),
        group_id=draw(TEXT),
        prompt_id=draw(TEXT),
        prompt_ids=draw(st.lists(INT32, max_size=5)),
        response_ids=draw(st.lists(INT32, max_size=5)),
        logprobs=draw(st.lists(FLOATS, max_size=5)),
        version=draw(INT64),
        versions_seen=draw(st.lists(INT64, max_size=3)),
        finish_reason=draw(REASONS),
        slice_id=draw(INT32),
        has_error=draw(st.booleans()),
        error=draw(TEXT),
        decode_s=draw(FLOATS),
    )


def _trajectory(data, run: RemoteRun) -> pb.Trajectory:
    """A garbage one, or a real in-flight request's result (of any slice), valid or with one field
    wrong. The draws do not depend on what is in flight (hypothesis replays them)."""
    garbage = data.draw(garbage_trajectory())
    real, index = data.draw(st.booleans()), data.draw(st.integers(0, 1000))
    changes = data.draw(st.one_of(*MUTATIONS.values())) or {}
    requests = run.in_flight(0) + run.in_flight(1)
    if not real or not requests:
        return garbage
    return codec.trajectory_to_proto(_result(requests[index % len(requests)], **changes))


def _post_finished(data, run: RemoteRun) -> None:
    fake = data.draw(st.sampled_from(run.fakes))
    trajectories = [_trajectory(data, run) for _ in range(data.draw(st.integers(0, 3)))]
    how = data.draw(st.sampled_from(["next", "any_seq", "no_session"]))
    if how == "next":  # on its session, in its sequence: only the content can be wrong
        fake.post(trajectories)
        return
    session = fake.client.session if how == "any_seq" else data.draw(TEXT)
    request = pb.FinishedRequest(session=session, seq=data.draw(st.integers(0, 2**64 - 1)), trajectories=trajectories)
    fake.client.stub.PostFinished(request, timeout=10)


def _ack(data, run: RemoteRun) -> None:
    fake = data.draw(st.sampled_from(run.fakes))
    session = data.draw(st.one_of(st.just(fake.client.session), TEXT))
    result = pb.Result(
        session=session,
        command_id=data.draw(st.integers(10**9, 2**64 - 1)),  # never a command pending now (see above)
        error=data.draw(TEXT),
        digest=data.draw(TEXT),
        reprefilled=data.draw(st.lists(TEXT, max_size=3)),
    )
    frames = list(codec.to_frames(result, []))
    match data.draw(st.sampled_from(["result", "chunk_first", "command", "empty"])):
        case "chunk_first":
            frames.insert(0, pb.Frame(chunk=data.draw(st.binary(max_size=64))))
        case "command":
            frames = [pb.Frame(command=pb.Command(id=1, keepalive=pb.Keepalive()))]
        case "empty":
            frames = []
    fake.client.stub.Ack(iter(frames), timeout=10)


def _register(data, run: RemoteRun) -> None:
    request = pb.RegisterRequest(
        role=data.draw(st.sampled_from([pb.ROLLOUT, pb.TRAINER, 2, 7])),
        slice_id=data.draw(st.one_of(st.integers(-2, 3), INT32)),
        num_slots=data.draw(st.one_of(st.just(4), INT32)),
        config_hash=data.draw(st.one_of(st.just(HASH), TEXT)),
        package_version=data.draw(st.one_of(st.just(dora_jax.__version__), TEXT)),
        protocol=data.draw(st.one_of(st.just(PROTOCOL), INT32)),
        host=data.draw(TEXT),
        host_id=data.draw(st.one_of(st.just(0), INT32)),
    )
    valid_trainer = request.role == pb.TRAINER and (
        request.config_hash,
        request.package_version,
        request.protocol,
        request.host_id,
    ) == (HASH, dora_jax.__version__, PROTOCOL, 0)
    assume(not valid_trainer)  # a restarted trainer: the run goes back to its checkpoint (by design)
    run.fakes[0].client.stub.Register(request, timeout=10)


def _evaluate(data, run: RemoteRun) -> None:
    """The trainer's Evaluate with any field: the newest version and a valid count start a real
    round (the run evaluates while it trains), anything else is refused."""
    session = data.draw(st.one_of(st.just(run.trainer.session), TEXT))
    request = pb.EvaluateRequest(
        session=session,
        version=data.draw(st.one_of(st.just(run.version), INT64)),
        samples=data.draw(st.one_of(st.integers(-1, 3), INT32)),
        wait_s=data.draw(st.one_of(st.just(math.nan), st.floats(-1e300, 0.05))),
    )
    run.trainer.stub.Evaluate(request, timeout=10)


SENDERS = {"finished": _post_finished, "ack": _ack, "register": _register, "evaluate": _evaluate}


def test_fuzzed_worker_messages_leave_the_service_alive_and_the_ledger_audited():
    run = RemoteRun(slices=2, held_out=HeldOut((("eval/0", (1, 2)), ("eval/1", (3,))), 2))
    answered = {"ok": 0, "refused": 0}
    try:
        run.train_to(1)

        @settings(
            max_examples=400,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(st.data())
        def send(data):
            kind = data.draw(st.sampled_from(sorted(SENDERS)))
            try:
                SENDERS[kind](data, run)
                answered["ok"] += 1
            except (grpc.RpcError, CallFailed, Refused, SessionLost) as err:
                code = err.code() if isinstance(err, grpc.RpcError) else None
                assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE), err  # no handler crashed
                answered["refused"] += 1
            assert not run.loop_error, run.loop_error

        with run.training():
            send()
        start = run.version
        run.train_to(start + 5)  # the server still serves every role: the run trains on
        assert not run.loop_error
        with __import__("pytest").raises(Refused, match="config hash"):
            run.trainer.register(pb.TRAINER, "0" * 64)
        report = audit(run.ledger.memory)
        assert report.ok, report.summary()
        assert report.consumed == run.version * 8 and run.coord.stats.consumed == run.version * 8
        failures = [e for e in run.ledger.memory if e["ev"] == "slice_failed"]
        assert {e["slice"] for e in failures} <= {0, 1}
        assert all(len(e["reason"]) < 800 and "\n" not in e["reason"] for e in failures), failures
        assert run.coord.stats.result_violations <= len(failures)
        finishes = [e for e in run.ledger.memory if e["ev"] == "finish"]
        assert all(e["versions_seen"] in ([], [e["version"]]) and e["tokens"] <= 200 for e in finishes)
        assert answered["ok"] + answered["refused"] == 400 and answered["refused"] > 0 and answered["ok"] > 0
        assert not any(math.isnan(e.get("t", 0.0)) for e in run.ledger.memory)
    finally:
        run.close()
