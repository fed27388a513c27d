"""The object-dtype Ack that used to kill the coordinator (signal 11: raw bytes written into an
object array) against a service in its own process: refused, and the process is alive after it."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest

import dora_jax
from dora_jax.transport import auth
from dora_jax.transport import dora_pb2 as pb
from dora_jax.transport import dora_pb2_grpc as pb_grpc
from dora_jax.transport.service import PROTOCOL
from tests.transport.guard_server import HASH, SECRET

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _object_ack(session: str):
    state = pb.SlotState(
        k=pb.Array(dtype="O", shape=[1]), v=pb.Array(dtype="O", shape=[1]), rng_key=pb.Array(dtype="O", shape=[1])
    )
    result = pb.Result(session=session, command_id=1, exported=[pb.Migratable(slot_state=state)])
    return iter([pb.Frame(result=result)] + [pb.Frame(chunk=b"\x41" * 8)] * 3)


@pytest.fixture
def server_process():
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.transport.guard_server"],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    line = proc.stdout.readline()
    assert line.startswith("port "), line
    yield proc, f"127.0.0.1:{int(line.split()[1])}"
    proc.stdin.close()
    proc.wait(timeout=30)


def test_the_object_dtype_ack_is_refused_and_the_server_lives(server_process):
    proc, address = server_process
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.CoordinatorStub(channel)
    token = [(auth.TOKEN_METADATA, auth.role_token(SECRET, auth.rollout(0)))]
    with pytest.raises(grpc.RpcError) as err:  # no token: refused before a frame is read
        stub.Ack(_object_ack("not-a-session"), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:  # a token, no session: refused before the arrays are read
        stub.Ack(_object_ack("not-a-session"), metadata=token, timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    register = pb.RegisterRequest(
        role=pb.ROLLOUT,
        slice_id=0,
        num_slots=4,
        config_hash=HASH,
        package_version=dora_jax.__version__,
        protocol=PROTOCOL,
    )
    session = stub.Register(register, metadata=token, timeout=10).session
    with pytest.raises(grpc.RpcError) as err:  # a live session: the dtype is refused before allocating
        stub.Ack(_object_ack(session), metadata=token, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dtype 'O' is not allowed" in err.value.details()
    assert proc.poll() is None  # alive
    assert stub.Register(register, metadata=token, timeout=10).session  # and serving
