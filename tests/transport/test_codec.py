"""Records through protobuf and frames: bit-exact, in chunks of any size; checked-in code matches
dora.proto."""

from __future__ import annotations

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
    for t in (traj, rejected):
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
