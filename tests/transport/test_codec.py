"""Records through protobuf and frames: bit-exact, in chunks of any size; checked-in code matches
dora.proto."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

from dora_jax.core.records import FinishReason, Group, Request, SamplingParams, ScoredTrajectory, SlotState, Trajectory
from dora_jax.transport import codec
from dora_jax.transport import dora_pb2 as pb

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _request(i=0, **kw):
    fields = dict(
        traj_id=f"g3/{i}",
        group_id="g3",
        prompt_id="p17",
        prompt_ids=(5, 9, 2, 70000),
        version=4,
        max_new_tokens=33,
        sampling=SamplingParams(temperature=0.9, top_p=0.95, top_k=7, seed=2**31 - 5),
        stop_ids=(3,),
        forced_length=None,
    )
    fields.update(kw)
    return Request(**fields)


def _slot_state(rng, rows=37):
    k = rng.standard_normal((2, rows, 2, 16)).astype(np.float32)
    k[0, 0, 0, :3] = [np.nan, -0.0, np.inf]  # odd values must survive too
    v = rng.standard_normal((2, rows, 2, 16)).astype(np.float32)
    return SlotState(
        _request(1, prefix_response_ids=(4, 4), prefix_logprobs=(-0.1, -2.5e-9), prefix_versions=(3, 4)),
        k,
        v,
        rows,
        11,
        (4, 4, 11),
        (-0.1, -2.5e-9, -1.2345678901234567),
        (3, 4, 4),
        np.asarray([123456789, 4294967295], np.uint32),
        4,
    )


def test_request_and_trajectory_round_trip():
    for request in (
        _request(),
        _request(forced_length=12, prefix_response_ids=(1,), prefix_logprobs=(-0.7,), prefix_versions=(2,)),
    ):
        back = codec.request_from_proto(pb.Request.FromString(codec.request_to_proto(request).SerializeToString()))
        assert back == request
    assert codec.request_from_proto(codec.request_to_proto(_request())).sampling.temperature == 0.9  # not float32
    traj = Trajectory(
        "g3/1",
        "g3",
        "p17",
        (5, 9),
        (4, 11, 2),
        (-0.25, -1e-30, -3.0000001),
        4,
        (4,),
        FinishReason.EOS,
        slice_id=2,
        error=None,
        dispatch_t=1.5,
        finish_t=2.25,
        num_migrations=1,
    )
    rejected = Trajectory("g3/2", "g3", "p17", (5,), (), (), 4, (), FinishReason.REJECTED, error="prompt_ids is empty")
    # Scored on its slice (trainer.behaviour_logps = "rollout"): the log-probs and the params digest
    # travel with it, every double bit-exact; an empty response scored still says it was.
    scored = dataclasses.replace(
        traj, behaviour_logprobs=(-0.25000001, -1e-30, -3.5), behaviour_digest="0a1b2c3d4e5f6789"
    )
    empty_scored = dataclasses.replace(rejected, behaviour_logprobs=(), behaviour_digest="d")
    for t in (traj, rejected, scored, empty_scored):
        assert (
            codec.trajectory_from_proto(pb.Trajectory.FromString(codec.trajectory_to_proto(t).SerializeToString())) == t
        )
    group = Group("g3", 4, (ScoredTrajectory(traj, 1.0), ScoredTrajectory(rejected, 0.0, "rejected: x")))
    assert codec.group_from_proto(pb.Group.FromString(codec.group_to_proto(group).SerializeToString())) == group


@pytest.mark.parametrize("chunk_bytes", [1, 1000, codec.DEFAULT_CHUNK_BYTES])
def test_slot_states_stream_in_chunks_bit_exact(chunk_bytes):
    rng = np.random.default_rng(0)
    states = [_slot_state(rng, 37), _slot_state(rng, 1)]
    items = [states[0], _request(5), states[1]]
    messages, arrays = codec.migratables_to_proto(items)
    result = pb.Result(session="s", command_id=9, exported=messages)
    frames = [pb.Frame.FromString(f.SerializeToString()) for f in codec.to_frames(result, arrays, chunk_bytes)]
    assert max(len(f.chunk) for f in frames[1:]) <= chunk_bytes
    ((message, got_arrays),) = list(codec.FrameReader(iter(frames)))
    back = codec.migratables_from_proto(message.exported, iter(got_arrays))
    assert isinstance(back[1], Request) and back[1] == items[1]
    for sent, got in ((states[0], back[0]), (states[1], back[2])):
        for name in ("k_LSKD", "v_LSKD", "rng_key"):
            a, b = getattr(sent, name), getattr(got, name)
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()  # bit-exact, NaN too
        assert (
            got.request,
            got.position,
            got.last_token,
            got.response_ids,
            got.logprobs,
            got.token_versions,
            got.version,
        ) == (
            sent.request,
            sent.position,
            sent.last_token,
            sent.response_ids,
            sent.logprobs,
            sent.token_versions,
            sent.version,
        )


def test_truncated_or_misaligned_streams_are_errors():
    state = _slot_state(np.random.default_rng(1), 4)
    messages, arrays = codec.migratables_to_proto([state])
    frames = list(codec.to_frames(pb.Result(exported=messages), arrays, 64))
    with pytest.raises(ValueError, match="stream ended after"):
        next(codec.FrameReader(iter(frames[:-1])))
    with pytest.raises(ValueError, match="where a message was expected"):
        next(codec.FrameReader(iter(frames[1:])))


@pytest.mark.slow
def test_checked_in_code_matches_the_proto(tmp_path):
    """grpcio-tools (the `test` extra) regenerates the modules; they must equal the checked-in ones."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            ".",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            "dora_jax/transport/dora.proto",
        ],
        cwd=ROOT,
        check=True,
    )
    for name in ("dora_pb2.py", "dora_pb2_grpc.py"):
        with (
            open(tmp_path / "dora_jax" / "transport" / name) as fresh,
            open(os.path.join(ROOT, "dora_jax", "transport", name)) as checked_in,
        ):
            assert fresh.read() == checked_in.read(), f"{name} is stale: regenerate it (see dora.proto)"


@pytest.mark.parametrize("dtype", sorted(codec.WIRE_DTYPES))
def test_every_allowed_dtype_round_trips_as_raw_bytes(dtype):
    """bfloat16 included (numpy cannot export it as a buffer: it goes as raw uint8)."""
    rng = np.random.default_rng(2)
    array = (rng.standard_normal((3, 5, 2)) * 50).astype(codec.WIRE_DTYPES[dtype])
    header = pb.SlotState(
        k=codec._array_header(array), v=codec._array_header(array[:1]), rng_key=codec._array_header(array[0, 0])
    )
    result = pb.Result(exported=[pb.Migratable(slot_state=header)])
    assert header.k.dtype == dtype
    frames = list(codec.to_frames(result, [array, array[:1], array[0, 0]], 7))
    _, back = next(codec.FrameReader(iter(pb.Frame.FromString(f.SerializeToString()) for f in frames)))
    for sent, got in zip([array, array[:1], array[0, 0]], back, strict=True):
        assert got.dtype == sent.dtype and got.shape == sent.shape and got.tobytes() == sent.tobytes()


def test_a_bfloat16_slot_state_round_trips():
    import ml_dtypes

    state = _slot_state(np.random.default_rng(3), 9)
    state = dataclasses.replace(
        state, k_LSKD=state.k_LSKD.astype(ml_dtypes.bfloat16), v_LSKD=state.v_LSKD.astype(ml_dtypes.bfloat16)
    )
    messages, arrays = codec.migratables_to_proto([state])
    ((message, got),) = list(codec.FrameReader(codec.to_frames(pb.Result(exported=messages), arrays, 100)))
    [back] = codec.migratables_from_proto(message.exported, iter(got))
    assert back.k_LSKD.dtype == ml_dtypes.bfloat16 and back.k_LSKD.tobytes() == state.k_LSKD.tobytes()
    assert back.v_LSKD.tobytes() == state.v_LSKD.tobytes() and back.rng_key.tobytes() == state.rng_key.tobytes()


def _announcing(dtype, shape):
    state = pb.SlotState(
        k=pb.Array(dtype=dtype, shape=shape),
        v=pb.Array(dtype="uint8", shape=[0]),
        rng_key=pb.Array(dtype="uint8", shape=[0]),
    )
    return pb.Frame(result=pb.Result(exported=[pb.Migratable(slot_state=state)]))


@pytest.mark.parametrize(
    "dtype,shape,error",
    [
        ("O", [1], "dtype 'O' is not allowed"),
        ("<f4", [1], "dtype '<f4' is not allowed"),
        ("V8", [1], "is not allowed"),
        ("float32", [-1], "sizes >= 0"),
        ("float32", [1] * 9, "rank <= 8"),
        ("float32", [1 << 40, 1 << 40], "exceeds the 1024-byte limit"),
        ("float32", [257], "exceeds the 1024-byte limit"),
    ],
)
def test_announced_arrays_are_checked_before_anything_is_allocated(dtype, shape, error):
    frames = iter([_announcing(dtype, shape), pb.Frame(chunk=b"\x41" * 8)])
    reader = codec.FrameReader(frames, max_array_bytes=1024)
    message = reader.next_message()
    with pytest.raises(ValueError, match=error):
        reader.read_arrays(message)
    assert next(frames).chunk == b"\x41" * 8  # not a byte of the arrays was read


def test_the_array_limit_covers_a_messages_arrays_together():
    state = pb.SlotState(
        k=pb.Array(dtype="float32", shape=[200]),
        v=pb.Array(dtype="float32", shape=[200]),
        rng_key=pb.Array(dtype="uint8", shape=[0]),
    )
    reader = codec.FrameReader(iter([pb.Frame(result=pb.Result(exported=[pb.Migratable(slot_state=state)]))]), 1024)
    with pytest.raises(ValueError, match="exceeds the 224-byte limit"):  # 1024 - 800 left for v
        reader.read_arrays(reader.next_message())


def test_an_object_array_cannot_be_sent():
    with pytest.raises(ValueError, match="dtype object cannot cross the wire"):
        list(codec.to_frames(pb.Result(), [np.array([b"x"], dtype=object)]))
