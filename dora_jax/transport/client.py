"""The client side of the coordinator service: channel, deadlines, retries, registration.

Every call has a deadline (`call_timeout_s`). A call that fails because the coordinator cannot be
reached (UNAVAILABLE, DEADLINE_EXCEEDED) is retried with exponential backoff until
`unreachable_after_s` has passed since the coordinator last answered; then `CoordinatorUnreachable`
says so, with the address and the last error. A refusal (wrong config, package version, slice id)
is `Refused` at once; a session the coordinator ended is `SessionLost`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

import dora_jax
from dora_jax.transport import dora_pb2 as pb
from dora_jax.transport import dora_pb2_grpc as pb_grpc
from dora_jax.transport.service import MAX_MESSAGE_BYTES, PROTOCOL, hostname

T = TypeVar("T")
_RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class CoordinatorUnreachable(RuntimeError):
    pass


class Refused(RuntimeError):
    pass


class SessionLost(RuntimeError):
    pass


class CallFailed(RuntimeError):
    """The coordinator answered a call with an error that retrying cannot fix (e.g. ABORTED: it
    stopped the run)."""


@dataclasses.dataclass(frozen=True)
class ClientTiming:
    call_timeout_s: float = 30.0  # deadline of one unary call
    unreachable_after_s: float = 120.0  # give up after the coordinator has not answered this long
    backoff_s: float = 0.2  # first retry delay; doubles up to max_backoff_s
    max_backoff_s: float = 5.0


def config_hash(config_json: dict) -> str:
    """A digest of the resolved config: every role of one run must hold the same."""
    return hashlib.sha256(json.dumps(config_json, sort_keys=True, default=str).encode()).hexdigest()


def open_channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(
        address,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )


class Client:
    """A stub plus the retry policy; `last_answer` is when the coordinator last answered."""

    def __init__(self, address: str, timing: ClientTiming = ClientTiming()):
        self.address = address
        self.timing = timing
        self.channel = open_channel(address)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.last_answer = time.monotonic()
        self.session = ""

    def call(self, what: str, fn: Callable[[float], T], *, also_retry=(), timeout_s: float | None = None) -> T:
        """`fn(timeout)` with retries; see the module docstring."""
        delay = self.timing.backoff_s
        timeout = self.timing.call_timeout_s if timeout_s is None else timeout_s
        while True:
            try:
                out = fn(timeout)
                self.last_answer = time.monotonic()
                return out
            except grpc.RpcError as err:
                code = err.code()
                if code == grpc.StatusCode.FAILED_PRECONDITION:
                    raise Refused(f"coordinator at {self.address} refused {what}: {err.details()}") from None
                if code == grpc.StatusCode.NOT_FOUND:
                    raise SessionLost(f"coordinator at {self.address}: {err.details()}") from None
                if code not in _RETRIED + tuple(also_retry):
                    raise CallFailed(f"{what} failed at {self.address}: {code.name}: {err.details()}") from None
                silent = time.monotonic() - self.last_answer
                if silent > self.timing.unreachable_after_s:
                    state = "unreachable" if code in _RETRIED else "still refusing"
                    raise CoordinatorUnreachable(
                        f"coordinator at {self.address} {state} for {silent:.0f}s "
                        f"(limit {self.timing.unreachable_after_s:.0f}s) during {what}; last error "
                        f"{code.name}: {err.details()}"
                    ) from None
                time.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(2 * delay, self.timing.max_backoff_s)

    def register(
        self, role: int, config_hash_: str, *, slice_id: int = -1, num_slots: int = 0, host_id: int = 0
    ) -> pb.RegisterReply:
        """Joins the run; a worker for a slice whose old session is still live waits for it to end."""
        request = pb.RegisterRequest(
            role=role,
            slice_id=slice_id,
            num_slots=num_slots,
            config_hash=config_hash_,
            package_version=dora_jax.__version__,
            protocol=PROTOCOL,
            host=hostname(),
            host_id=host_id,
        )
        self.last_answer = time.monotonic()
        reply = self.call(
            "Register", lambda t: self.stub.Register(request, timeout=t), also_retry=(grpc.StatusCode.ALREADY_EXISTS,)
        )
        self.session = reply.session
        return reply

    def close(self) -> None:
        self.channel.close()
