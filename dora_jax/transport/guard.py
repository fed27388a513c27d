"""The coordinator's gate: who may call each method, how big a request may be, how many calls a
caller may hold open. One gRPC server interceptor (`Guard`) applies `METHOD_RULES` to every call
before the service sees it.

The interceptor runs on the server's polling thread, before the call takes a worker thread and
before any request byte is read. A refused call gets a handler that reads no request (its
request is never received, let alone parsed) and ends the call with:
  UNAUTHENTICATED    no token, or one the run secret did not make
  PERMISSION_DENIED  a valid token whose role may not call the method, or a method the table lacks
and the caller learns nothing else (no version, hash or session). Methods are refused unless the
table names them (a method added to dora.proto is closed until its row is written).

An admitted call runs with its context wrapped in `Authenticated` (`principal_of(context)`): the
service checks, first thing, what the interceptor cannot see in the request (that a rollout
token registers its own slice, that a session belongs to its caller). Then:
  - a request of a method that carries no arrays, trajectories or state is refused
    (INVALID_ARGUMENT) over `SMALL_REQUEST_BYTES`, before it is parsed; gRPC's own limit (the
    server's `max_receive_message_length`, one for every method) bounds the others;
  - a caller holds at most `per_caller` calls of a long-lived method at once (command streams,
    result streams, long-polls); one more is refused at once (RESOURCE_EXHAUSTED). So the threads
    long-lived calls can take are bounded (`long_call_threads`) and the server's pool is sized
    above that: Register and Heartbeat always find a thread.
Strings a client sent are logged through `shown` only: truncated and escaped.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import grpc

from dora_jax.transport.auth import TOKEN_METADATA, Authenticator, Kind, Principal, Unauthenticated

SERVICE = "dora_jax.transport.Coordinator"
SMALL_REQUEST_BYTES = 64 << 10  # a Register, Heartbeat, TakeBatch, ... request is well under 1 KiB
SHORT_CALL_THREADS = 32  # threads for short calls (Register, Heartbeat, posts) beyond the long-lived ones

BOTH = frozenset({Kind.TRAINER, Kind.ROLLOUT})
ROLLOUT = frozenset({Kind.ROLLOUT})
TRAINER = frozenset({Kind.TRAINER})


@dataclasses.dataclass(frozen=True)
class MethodRule:
    callers: frozenset[Kind]  # the roles whose token may call it
    small: bool  # its request carries no arrays, trajectories or state: at most SMALL_REQUEST_BYTES
    per_caller: int | None  # calls one caller may hold at once (long-lived methods); None: short calls


# Who may call what. Every method of the Coordinator service has a row (tests/transport/test_guard.py
# walks the service descriptor); a method without one is refused to everyone.
METHOD_RULES: dict[str, MethodRule] = {
    "Register": MethodRule(BOTH, small=True, per_caller=None),  # a rollout token: its own slice only
    "Heartbeat": MethodRule(ROLLOUT, small=True, per_caller=None),
    "Commands": MethodRule(ROLLOUT, small=True, per_caller=2),  # open for a session's life; 2: a rejoin overlaps
    "Ack": MethodRule(ROLLOUT, small=False, per_caller=2),  # a Result and its arrays' bytes
    "PostFinished": MethodRule(ROLLOUT, small=False, per_caller=4),  # trajectories
    "TakeBatch": MethodRule(TRAINER, small=True, per_caller=4),  # long-poll
    "ReportPublished": MethodRule(TRAINER, small=True, per_caller=4),
    "Snapshot": MethodRule(TRAINER, small=True, per_caller=2),  # waits for the coordinator's loop
    "Resume": MethodRule(TRAINER, small=False, per_caller=2),  # a checkpoint's coordinator state
    "Evaluate": MethodRule(TRAINER, small=True, per_caller=4),  # long-poll of an evaluation round
    "Finish": MethodRule(TRAINER, small=True, per_caller=2),  # waits for the last publish's ledger
}


def long_call_threads(num_slices: int, rules: dict[str, MethodRule] = METHOD_RULES) -> int:
    """The most threads the capped methods can hold at once in a run of `num_slices` slices."""
    callers = {Kind.TRAINER: 1, Kind.ROLLOUT: num_slices}
    return sum(r.per_caller * sum(callers[k] for k in r.callers) for r in rules.values() if r.per_caller)


def shown(text: str, limit: int = 64) -> str:
    """A client's string as a log may show it: escaped (repr: no newline, no control character can
    forge a line) and cut to `limit` characters, saying how many were cut."""
    text = str(text)
    cut = f"...(+{len(text) - limit} chars)" if len(text) > limit else ""
    return repr(text[:limit]) + cut


@dataclasses.dataclass
class Authenticated:
    """A call's context with the principal its token proved (None: the server checks no tokens);
    everything else is the gRPC context's."""

    context: grpc.ServicerContext
    principal: Principal | None

    def __getattr__(self, name):
        return getattr(self.context, name)


def principal_of(context) -> Principal | None:
    """Who made the call, or None where no token was checked (a server built without `auth`, or
    a handler called directly)."""
    return context.principal if isinstance(context, Authenticated) else None


class _Oversized:
    def __init__(self, nbytes: int):
        self.nbytes = nbytes


class _Slots:
    """Calls in flight per (method, caller), against each rule's `per_caller`."""

    def __init__(self, num_callers: int):
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str], int] = {}
        self._num_callers = num_callers  # without authentication every caller counts as one

    def take(self, method: str, rule: MethodRule, principal: Principal | None) -> tuple[str, str] | None:
        key = (method, principal.name if principal else "*")
        cap = rule.per_caller * (1 if principal else self._num_callers)
        with self._lock:
            if self._held.get(key, 0) >= cap:
                return None
            self._held[key] = self._held.get(key, 0) + 1
        return key

    def give_back(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._held[key] -= 1


class _RefusalLog:
    """Refusals are logged, at most `burst` lines a minute (a flood of bad calls cannot fill the
    disk); the count of those not shown is logged with the next line shown."""

    def __init__(self, log: Callable[[str], None], burst: int = 20):
        self._log, self._burst = log, burst
        self._lock = threading.Lock()
        self._window, self._shown, self._dropped = 0.0, 0, 0

    def __call__(self, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._window > 60.0:
                self._window, self._shown = now, 0
            if self._shown >= self._burst:
                self._dropped += 1
                return
            self._shown += 1
            dropped, self._dropped = self._dropped, 0
        self._log(message + (f" ({dropped} more refusals not logged)" if dropped else ""))


class Guard(grpc.ServerInterceptor):
    """Applies `rules` to every call; `authenticator` None checks no tokens (in-process tests)."""

    def __init__(
        self,
        authenticator: Authenticator | None,
        num_slices: int,
        *,
        log: Callable[[str], None],
        rules: dict[str, MethodRule] = METHOD_RULES,
    ):
        self._auth, self._rules = authenticator, rules
        self._slots = _Slots(num_slices + 1)
        self._log = _RefusalLog(log)

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None:
            return None  # UNIMPLEMENTED, as gRPC says it
        service, _, method = details.method.lstrip("/").rpartition("/")
        rule = self._rules.get(method) if service == SERVICE else None
        if rule is None:
            return self._refuse(handler, grpc.StatusCode.PERMISSION_DENIED, "method not allowed", details.method)
        principal = None
        if self._auth is not None:
            token = next((v for k, v in details.invocation_metadata or () if k == TOKEN_METADATA), None)
            try:
                principal = self._auth.authenticate(token if isinstance(token, str) else None)
            except Unauthenticated:
                return self._refuse(handler, grpc.StatusCode.UNAUTHENTICATED, "missing or invalid run token", method)
            if principal.kind not in rule.callers:
                return self._refuse(
                    handler, grpc.StatusCode.PERMISSION_DENIED, "this role may not call this method", method, principal
                )
        return self._admit(handler, method, rule, principal)

    def _refuse(self, handler, code: grpc.StatusCode, why: str, method: str, principal: Principal | None = None):
        """A handler that reads nothing of the request and ends the call with `code`."""
        self._log(f"refused a call of {shown(method)}{f' by {principal.name}' if principal else ''}: {why}")

        def abort(_request_iterator, context):
            context.abort(code, why)

        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(abort)
        return grpc.stream_unary_rpc_method_handler(abort)

    def _admit(self, handler, method: str, rule: MethodRule, principal: Principal | None):
        """`handler` with its request's size checked before parsing, its slot held while it runs,
        and its context carrying the principal."""
        deserialize = handler.request_deserializer
        if rule.small:

            def deserialize(raw: bytes, parse=handler.request_deserializer):
                return _Oversized(len(raw)) if len(raw) > SMALL_REQUEST_BYTES else parse(raw)

        def admitted(context) -> Callable[[], None]:
            """Takes the call's slot; returns what gives it back, once: when the call ends (a caller
            that went away frees its slot at once, not when a blocked stream handler next wakes)
            or when the handler returns, whichever comes first."""
            key = self._slots.take(method, rule, principal) if rule.per_caller else None
            if rule.per_caller and key is None:
                self._log(f"refused a call of {method} by {principal.name if principal else 'a client'}: too many open")
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"too many concurrent {method} calls from this role")
            if key is None:
                return lambda: None
            once = threading.Lock()

            def release() -> None:
                if once.acquire(blocking=False):
                    self._slots.give_back(key)

            context.add_callback(release)
            return release

        def checked(request, context):
            if isinstance(request, _Oversized):
                self._log(f"refused a call of {method}: a request of {request.nbytes} bytes")
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"a {method} request of {request.nbytes} bytes exceeds its {SMALL_REQUEST_BYTES}-byte limit",
                )
            return request

        kind, behaviour = _behaviour(handler)
        if handler.request_streaming:
            oversized = checked
            checked = lambda requests, context: (oversized(r, context) for r in requests)  # noqa: E731

        if handler.response_streaming:

            def run(request, context):
                release = admitted(context)
                try:
                    yield from behaviour(checked(request, context), Authenticated(context, principal))
                finally:
                    release()
        else:

            def run(request, context):
                release = admitted(context)
                try:
                    return behaviour(checked(request, context), Authenticated(context, principal))
                finally:
                    release()

        return handler._replace(request_deserializer=deserialize, **{kind: run})


def _behaviour(handler) -> tuple[str, Callable]:
    kind = ("stream_" if handler.request_streaming else "unary_") + (
        "stream" if handler.response_streaming else "unary"
    )
    return kind, getattr(handler, kind)
