"""The client side of the coordinator service: channel, deadlines, retries, registration.

Every call has a deadline (`call_timeout_s`). A call that fails because the coordinator cannot be
reached (UNAVAILABLE, DEADLINE_EXCEEDED) is retried with exponential backoff until
`unreachable_after_s` has passed since the coordinator last answered; then `CoordinatorUnreachable`
says so, with the address and the last error. A refusal (wrong config, package version, slice id,
a token the coordinator does not accept) is `Refused` at once; a session the coordinator ended is
`SessionLost`. RESOURCE_EXHAUSTED (too many calls in flight at the coordinator) is retried.

With `ClientCredentials` every call carries the role's token (metadata `x-dora-token`, added by a
client interceptor), and with a CA the channel is TLS pinned to it (dora_jax/transport/auth.py).
"""

from __future__ import annotations

import collections
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
from dora_jax.transport.auth import TOKEN_METADATA, ClientCredentials
from dora_jax.transport.service import MAX_MESSAGE_BYTES, PROTOCOL, hostname
from dora_jax.transport.tls import SERVER_NAME

T = TypeVar("T")
_RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED)
_REFUSED = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


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


def open_channel(address: str, credentials: ClientCredentials | None = None) -> grpc.Channel:
    """A channel to the coordinator: plaintext, or TLS pinned to the run's CA; every call with
    the role's token when `credentials` are given."""
    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]
    if credentials is not None and credentials.ca_pem is not None:
        tls = grpc.ssl_channel_credentials(root_certificates=credentials.ca_pem)
        channel = grpc.secure_channel(address, tls, options=[*options, ("grpc.ssl_target_name_override", SERVER_NAME)])
    else:
        channel = grpc.insecure_channel(address, options=options)
    if credentials is None:
        return channel
    return grpc.intercept_channel(channel, _Token(credentials.token))


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class _Token(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the role's token to every call's metadata."""

    def __init__(self, token: str):
        self._metadata = (TOKEN_METADATA, token)

    def _details(self, details):
        return _CallDetails(
            details.method,
            details.timeout,
            [*(details.metadata or ()), self._metadata],
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


class Client:
    """A stub plus the retry policy; `last_answer` is when the coordinator last answered."""

    def __init__(
        self, address: str, timing: ClientTiming = ClientTiming(), credentials: ClientCredentials | None = None
    ):
        self.address = address
        self.timing = timing
        self.channel = open_channel(address, credentials)
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
                if code in _REFUSED:
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
        self,
        role: int,
        config_hash_: str,
        *,
        slice_id: int = -1,
        num_slots: int = 0,
        host_id: int = 0,
        transfer_address: str = "",
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
            transfer_address=transfer_address,
        )
        self.last_answer = time.monotonic()
        reply = self.call(
            "Register", lambda t: self.stub.Register(request, timeout=t), also_retry=(grpc.StatusCode.ALREADY_EXISTS,)
        )
        self.session = reply.session
        return reply

    def close(self) -> None:
        self.channel.close()
