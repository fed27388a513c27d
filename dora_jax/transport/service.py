"""The coordinator's gRPC service: sessions, rollout command streams, the trainer's calls.

Rollout workers `Register` (refused, with the reason, on a config hash, package version, protocol,
slice id or slot count that does not match), open their `Commands` stream, `Heartbeat`, answer
each command with one `Ack` and post finished trajectories with `PostFinished` (in order: a worker
posts what finished before it answers its next command, so an export's result finds the
coordinator's view exact). The trainer registers too and calls `TakeBatch` (long-poll, idempotent
per trainer version) and `ReportPublished`; `Snapshot` gives it the coordinator's state for its
checkpoint, `Resume` (told to in its `RegisterReply` when the workdir already held a run)
hands a restored checkpoint's state back before its first `ReportPublished`, `Evaluate` starts and
polls an evaluation round of a version on the coordinator's own held-out prompts (`HeldOut`), and
`Finish` says the run is over (the coordinator then stops the workers and exits).

A rollout session ends when its stream breaks, its heartbeats stop for `heartbeat_timeout_s`, or a
call to it fails; its port fails and the coordinator gets `post_slice_failed`. A worker that then
registers again for the same slice joins through `post_slice_joined` with a fresh port.

Who may call what is decided before a handler runs (dora_jax/transport/guard.py: role tokens,
request sizes, calls in flight); a handler first checks what only the request shows: that a
rollout token registers its own slice and uses its own session (`_session`). Refusals name what
the caller must fix on its side, never the coordinator's own values (version, hash, sessions).

The service starts before the Coordinator exists (the coordinator needs every slice's port and the
trainer's first version): `wait_ready` returns those, then `attach` hands the coordinator over.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Protocol

import grpc

from dora_jax.coordinator import intake
from dora_jax.core.records import Group, Trajectory
from dora_jax.transport import auth, codec, guard
from dora_jax.transport import dora_pb2 as pb
from dora_jax.transport import dora_pb2_grpc as pb_grpc
from dora_jax.transport.guard import principal_of, shown
from dora_jax.transport.port import GrpcRolloutPort

PROTOCOL = 4  # bump on any incompatible change to dora.proto's meaning (3: arrays' dtypes by name; 4: TakeBatch commit)
MAX_MESSAGE_BYTES = 512 << 20  # a TakeBatch reply carries a whole training batch, Resume a whole state
MAX_HOST_CHARS = 255  # a host name or transfer server address (DNS names are at most 253)
MAX_WAIT_S = 60.0  # the longest a long-poll (TakeBatch, Evaluate) holds its thread
MAX_EVAL_ROUNDS = 8  # evaluation rounds asked and not finished at once; finished ones kept for a retry


@dataclasses.dataclass(frozen=True)
class Identity:
    """What every client must match to join."""

    config_hash: str
    package_version: str
    num_slices: int
    num_slots: int
    # Trainer hosts that may register: host 0 alone talks to the coordinator (the others follow
    # it over JAX), so one trainer session at most, replaced by the next registration.
    trainer_hosts: int = 1


@dataclasses.dataclass(frozen=True)
class Timing:
    heartbeat_period_s: float = 1.0  # clients beat this often
    heartbeat_timeout_s: float = 30.0  # a rollout worker silent this long is failed
    command_timeout_s: float = 600.0  # a command unanswered this long fails its slice
    keepalive_s: float = 2.0  # an idle command stream carries a keepalive this often
    # A dropped slice's worker is waited for this long to register again (a worker whose session
    # ended re-registers by itself; a dead one is started again by `launch_local --max_restarts`
    # or the pod's restart): with every slice down, the run stops only once this has passed.
    rejoin_timeout_s: float = 600.0
    chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES
    first_frame_s: float = 10.0  # an Ack stream whose Result has not come this long is cancelled
    max_array_bytes: int = codec.DEFAULT_MAX_ARRAY_BYTES  # what one Ack's arrays may hold in all


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """What `Evaluate` evaluates: the coordinator's own held-out prompts ((prompt id, token ids)
    pairs, dora_jax.tasks.eval_set), the most sampled responses a round may ask per prompt
    (`eval.samples`), and `leak_counts()`, the training prompts seen so far that are also
    evaluation prompts (the keys of an evaluation row that only the prompts' drawer knows)."""

    prompts: tuple[tuple[str, tuple[int, ...]], ...]
    max_samples: int
    leak_counts: Callable[[], dict] = dict


class Backend(Protocol):
    """What the service calls on the coordinator (dora_jax.coordinator.coordinator.Coordinator)."""

    def post_finished(self, slice_id: int, trajectories: Sequence[Trajectory]) -> None: ...
    def post_slice_failed(self, slice_id: int, reason: str) -> None: ...
    def post_slice_joined(self, port) -> None: ...
    def post_slice_wont_rejoin(self, slice_id: int, reason: str) -> None: ...
    def record_behaviour(self, step: int, digests) -> None: ...
    def take_batch(self, trainer_version: int, timeout=None, cancel=None, idle=None) -> list[Group] | None: ...
    def peek_batch(self, trainer_version: int, committed: bool = False) -> list[Group]: ...
    def request_eval(self, version: int, step: int, prompts, samples: int) -> Future: ...


class _Peeked(Exception):
    """A TakeBatch with `peek` stops waiting: there are finished groups to show the trainer."""


@dataclasses.dataclass
class _Session:
    role: int
    host: str
    slice_id: int = -1
    port: GrpcRolloutPort | None = None
    transfer_address: str = ""  # a rollout slice's transfer server: the only address its KV tickets may name
    last_beat: float = dataclasses.field(default_factory=time.monotonic)
    finished_seq: int = 0
    counters: dict = dataclasses.field(default_factory=dict)


class CoordinatorService(pb_grpc.CoordinatorServicer):
    def __init__(self, identity: Identity, timing: Timing = Timing(), *, resume: bool = False, log=None):
        self.identity = identity
        self.resume = resume  # the workdir held a run: wait for the trainer's Resume
        self.resume_state: dict | None = None  # what Resume handed over ({} for "start over")
        self.finished = threading.Event()  # the trainer called Finish: the run is over
        self.generation = 0  # bumped when a restarted trainer sends the run back to its checkpoint
        self._snapshot_extra = None  # see attach()
        self._held_out: HeldOut | None = None  # see attach(); None: Evaluate is refused
        self._evals: dict[int, tuple[int, Future]] = {}  # version -> (samples, the round's result)
        self.timing = timing
        self._log = log or (lambda message: print(f"[coordinator] {message}", file=sys.stderr, flush=True))
        self._cond = threading.Condition()
        self._sessions: dict[str, _Session] = {}
        self.ports: dict[int, GrpcRolloutPort] = {}  # live port per slice
        self._trainers: dict[int, str] = {}  # host_id -> session (a multi-host trainer: one per host)
        self.initial_version: int | None = None
        self._published = -1
        self._taken: tuple[int, pb.TakeBatchReply] | None = None
        self.backend = None
        self.failures: list[tuple[int, str]] = []
        self._retired_counters: dict[str, int] = {}  # counters of ended sessions (bubble ratio totals)
        self._rejoins: dict[int, tuple[float, str]] = {}  # dropped slice -> (deadline to rejoin, why dropped)
        # Slices whose session this service ended and posted as failed, until the coordinator drops
        # them: that drop answers the failure, so it must not end the slice's newer session.
        self._posted_failures: set[int] = set()
        self._deadlines: dict[int, tuple[float, object]] = {}  # id -> (when, call context) to cancel
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch_heartbeats, name="heartbeats", daemon=True)
        self._monitor.start()

    # ------------------------------------------------------------------ lifecycle
    def wait_ready(self, timeout_s: float) -> tuple[dict[int, GrpcRolloutPort], int]:
        """Blocks until every slice's command stream is open and the trainer reported its first
        version; returns (ports, that version). Names what is missing on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._ready():
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [
                        s
                        for s in range(self.identity.num_slices)
                        if s not in self.ports or not self.ports[s].connected.is_set()
                    ]
                    trainer = "nothing" if self.initial_version is None else f"version {self.initial_version}"
                    raise TimeoutError(
                        f"not every role joined within {timeout_s:.0f}s: rollout slices missing "
                        f"{missing}, trainer published {trainer}"
                    )
                self._cond.wait(min(left, 0.2))
            return dict(self.ports), self.initial_version

    def _ready(self) -> bool:
        slices = all(s in self.ports and self.ports[s].connected.is_set() for s in range(self.identity.num_slices))
        resumed = not self.resume or self.resume_state is not None
        return slices and self.initial_version is not None and resumed

    def attach(
        self,
        backend,
        known_ports: Sequence[GrpcRolloutPort] = (),
        *,
        snapshot_extra=None,
        held_out: HeldOut | None = None,
    ) -> None:
        """Hands over the coordinator built from `known_ports` (what `wait_ready` returned); a
        slice that joined since then joins it now. What only the coordinator's process knows goes
        into a `Snapshot`: `snapshot_extra()`, taken with the state under the coordinator's lock
        (the prompt source's position, and under "prompts" the prompts the state still refers to),
        as the state's `extra`. `held_out`: what `Evaluate` evaluates (None: the run evaluates
        nothing)."""
        with self._cond:
            self.backend = backend
            self._posted_failures.clear()  # posted to an earlier coordinator
            self._snapshot_extra = snapshot_extra
            self._held_out = held_out
            late = [p for p in self.ports.values() if p.connected.is_set() and p not in known_ports]
            self._cond.notify_all()
        for port in late:
            backend.post_slice_joined(port)

    def stop(self, reason: str) -> None:
        """Asks every live worker to exit and stops watching heartbeats."""
        self._stop.set()
        with self._cond:
            ports = list(self.ports.values())
        for port in ports:
            port.stop(reason)

    def worker_counters(self) -> dict[str, int]:
        """Slot steps, idle slot steps and generated tokens over every rollout session so far."""
        with self._cond:
            total = dict(self._retired_counters)
            for session in self._sessions.values():
                for key, value in session.counters.items():
                    total[key] = total.get(key, 0) + value
            return total

    # ------------------------------------------------------------------ sessions
    def _session(self, session_id: str, context, role: int) -> _Session:
        """The caller's live session; NOT_FOUND for one that is not live or not the caller's (a
        rollout token uses only sessions of its own slice)."""
        with self._cond:
            session = self._sessions.get(session_id)
        principal = principal_of(context)
        if (
            session is None
            or session.role != role
            or (principal is not None and principal != _principal(session.role, session.slice_id))
        ):
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                "session is not live (ended by the coordinator or never registered); register again",
            )
        return session

    def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterReply:
        principal = principal_of(context)
        if principal is not None and principal != _principal(request.role, request.slice_id):
            self._log(f"refused a registration by {principal.name}: it asked for another role or slice")
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "this token may register only its own role and slice")
        problem = self._refusal(request)
        if problem:
            self._log(f"refused a registration from {shown(request.host)}: {problem}")
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        session_id = uuid.uuid4().hex
        rewind: list[GrpcRolloutPort] = []
        with self._cond:
            if request.role == pb.TRAINER and request.host_id == 0 and self.backend is not None:
                rewind = self._rewind()
            if request.role == pb.TRAINER:
                old = self._trainers.get(request.host_id)
                if old is not None:
                    self._end_session(old)  # a restarted trainer host replaces the old one
                self._trainers[request.host_id] = session_id
                self._sessions[session_id] = _Session(pb.TRAINER, request.host)
            else:
                live = self.ports.get(request.slice_id)
                if live is not None and live.failure is None and live.connected.is_set():
                    context.abort(
                        grpc.StatusCode.ALREADY_EXISTS,
                        f"rollout slice {request.slice_id} is already served by a live worker; retry once it is gone",
                    )
                stale = live if live is not None and live.failure is None else None
                port = GrpcRolloutPort(
                    request.slice_id,
                    request.num_slots,
                    session_id,
                    command_timeout_s=self.timing.command_timeout_s,
                    on_fail=self._port_failed,
                )
                self.ports[request.slice_id] = port
                self._sessions[session_id] = _Session(
                    pb.ROLLOUT, request.host, request.slice_id, port, transfer_address=request.transfer_address
                )
            self._cond.notify_all()
        if request.role == pb.ROLLOUT and stale is not None:  # registered, died before its stream opened
            stale.fail("replaced by a new registration of its slice")
        for port in rewind:  # each worker drops its requests and joins again with nothing loaded
            port.fail("the trainer restarted: the run goes back to its newest checkpoint")
        self._log(
            f"registered {pb.Role.Name(request.role).lower()} "
            f"{'' if request.role == pb.TRAINER else f'slice {request.slice_id} '}from {shown(request.host)}"
        )
        return pb.RegisterReply(
            session=session_id,
            heartbeat_period_s=self.timing.heartbeat_period_s,
            resume=self.resume and request.role == pb.TRAINER,
        )

    def _rewind(self) -> list[GrpcRolloutPort]:
        """A trainer joined a running run (it was restarted): the trainer's state is back at its
        newest checkpoint, so the coordinator must be too. Detaches the running coordinator (the
        serving loop sees `generation` change, closes it and builds the next one from the state
        the trainer hands over with Resume) and returns the rollout ports to end. Caller holds
        self._cond."""
        self.backend = None
        self.generation += 1
        self.resume, self.resume_state = True, None
        self.initial_version, self._published, self._taken = None, -1, None
        self._evals = {}  # the rewound generation's rounds never finish
        self._cond.notify_all()
        self._log("the trainer joined a running run: going back to its newest checkpoint")
        return list(self.ports.values())

    def _refusal(self, request: pb.RegisterRequest) -> str | None:
        """Why `request` cannot join, in words that show only the caller's own values."""
        ident = self.identity
        if len(request.host) > MAX_HOST_CHARS or len(request.transfer_address) > MAX_HOST_CHARS:
            return f"host or transfer_address longer than {MAX_HOST_CHARS} characters"
        if request.protocol != PROTOCOL:
            return f"protocol {request.protocol} differs from the coordinator's: install the same dora_jax"
        if request.package_version != ident.package_version:
            return (
                f"package version {shown(request.package_version, 32)} differs from the coordinator's: "
                "install the same dora_jax on every host"
            )
        if request.config_hash != ident.config_hash:
            return (
                f"config hash {shown(request.config_hash[:12], 12)[1:-1]} differs from the coordinator's: "
                "start every role with the same --config file and the same --config.* overrides"
            )
        if request.role == pb.ROLLOUT:
            if not 0 <= request.slice_id < ident.num_slices:
                return (
                    f"slice_id={request.slice_id}; expected 0..{ident.num_slices - 1} "
                    f"(rollout.num_slices={ident.num_slices})"
                )
            if request.num_slots != ident.num_slots:
                return f"num_slots={request.num_slots}; the config says rollout.slots={ident.num_slots}"
        elif request.role != pb.TRAINER:
            return f"role={request.role}; expected ROLLOUT or TRAINER"
        elif not 0 <= request.host_id < ident.trainer_hosts:
            return f"trainer host_id={request.host_id}; expected 0..{ident.trainer_hosts - 1}"
        return None

    def _end_session(self, session_id: str) -> None:
        session = self._sessions.pop(session_id, None)  # caller holds self._cond
        if session is not None:
            for key, value in session.counters.items():
                self._retired_counters[key] = self._retired_counters.get(key, 0) + value

    def _port_failed(self, port: GrpcRolloutPort, reason: str) -> None:
        with self._cond:
            self._end_session(port.session)
            if self.ports.get(port.slice_id) is port:
                del self.ports[port.slice_id]
            backend = self.backend
            self.failures.append((port.slice_id, reason))
            if backend is not None and port.connected.is_set() and not port.stopping:  # a port it knows
                self._posted_failures.add(port.slice_id)
        if port.stopping:
            return
        self._log(f"rollout slice {port.slice_id} failed: {reason}")
        if backend is not None:
            backend.post_slice_failed(port.slice_id, reason)

    def slice_dropped(self, slice_id: int, reason: str) -> bool:
        """The coordinator dropped this slice (a failed call, a store error while loading): its
        session ends, so the worker stops decoding what was re-dispatched, registers again and
        rejoins with nothing loaded. Returns True, the coordinator's `on_slice_dropped` promise
        that the slice will join again: a live worker registers again by itself and a dead one is
        restarted by its launcher. The promise holds for `rejoin_timeout_s`; a slice that has not
        registered again by then is posted as `post_slice_wont_rejoin` (with no slice left, the run
        then stops). Called on the coordinator's loop; never calls back in.

        A drop that answers a failure this service posted leaves the slice's port alone: that
        session has ended already, and the port now registered, if any, is a newer session of the
        worker that joined again before the coordinator got to the failure (ending it would cost
        one more rejoin for nothing)."""
        with self._cond:
            answered = slice_id in self._posted_failures
            self._posted_failures.discard(slice_id)
            current = self.ports.get(slice_id)
            port = None if answered else current
            rejoined = answered and current is not None and current.connected.is_set()
            if not rejoined:  # (a rejoined session is posted to the coordinator already)
                self._rejoins[slice_id] = (time.monotonic() + self.timing.rejoin_timeout_s, reason)
        if port is not None:
            port.fail(f"dropped by the coordinator: {reason}")
            with self._cond:
                self._posted_failures.discard(slice_id)  # that failure is this drop's own
        return True

    def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatReply:
        session = self._session(request.session, context, pb.ROLLOUT)
        with self._cond:
            session.last_beat = time.monotonic()
            session.counters = {
                "slot_steps": request.slot_steps,
                "idle_slot_steps": request.idle_slot_steps,
                "generated_tokens": request.generated_tokens,
                "kv_preemptions": request.preemptions,
            }
        return pb.HeartbeatReply()

    def _watch_heartbeats(self) -> None:
        while not self._stop.wait(min(1.0, self.timing.heartbeat_timeout_s / 4)):
            now = time.monotonic()
            with self._cond:
                late = [
                    s.port
                    for s in self._sessions.values()
                    if s.port is not None
                    and s.port.connected.is_set()
                    and now - s.last_beat > self.timing.heartbeat_timeout_s
                ]
            for port in late:
                port.fail(f"no heartbeat for {self.timing.heartbeat_timeout_s:.0f}s")
            self._post_missed_rejoins(now)
            self._cancel_overdue(now)

    def _arm(self, context, seconds: float) -> int:
        """Cancels the call of `context` unless `_disarm`ed within `seconds` (checked by the
        heartbeat monitor, to within a second): a stream that sends nothing frees its thread."""
        key = id(context)
        with self._cond:
            self._deadlines[key] = (time.monotonic() + seconds, context)
        return key

    def _disarm(self, key: int) -> None:
        with self._cond:
            self._deadlines.pop(key, None)

    def _cancel_overdue(self, now: float) -> None:
        with self._cond:
            overdue = [(k, c) for k, (when, c) in self._deadlines.items() if now > when]
            for key, _ in overdue:
                del self._deadlines[key]
        for _, context in overdue:
            context.cancel()

    def _post_missed_rejoins(self, now: float) -> None:
        with self._cond:
            missed = {sid: why for sid, (deadline, why) in self._rejoins.items() if now > deadline}
            for sid in missed:
                del self._rejoins[sid]
            backend = self.backend
        for sid, why in missed.items():
            if backend is not None:
                backend.post_slice_wont_rejoin(
                    sid, f"did not register again within rejoin_timeout_s={self.timing.rejoin_timeout_s:g}s ({why})"
                )

    # ------------------------------------------------------------------ rollout streams
    def Commands(self, request: pb.CommandsRequest, context):
        session = self._session(request.session, context, pb.ROLLOUT)
        port = session.port
        context.add_callback(lambda: port.fail("command stream closed"))  # no-op once failed or stopped
        with self._cond:
            session.last_beat = time.monotonic()
            port.connected.set()
            self._rejoins.pop(port.slice_id, None)
            backend = self.backend
            self._cond.notify_all()
        if backend is not None:  # a slice (re)joining a running coordinator
            backend.post_slice_joined(port)
        while context.is_active() and port.failure is None:
            frames = port.next_frames(self.timing.keepalive_s, self.timing.chunk_bytes)
            if frames is None:
                frames = [pb.Frame(command=pb.Command(keepalive=pb.Keepalive()))]
            yield from frames
            if frames[0].command.WhichOneof("kind") == "stop":
                port.fail("stopped")
                return
        if port.failure is not None and context.is_active():
            context.abort(grpc.StatusCode.NOT_FOUND, f"session of slice {port.slice_id} ended: {port.failure}")

    def Ack(self, request_iterator, context) -> pb.ResultReply:
        """One Result, then its arrays' bytes: the session is checked before a byte of an array is
        read, and each array's dtype and size before it is allocated (codec.FrameReader). The
        Result must come within `first_frame_s`, the whole stream within `command_timeout_s`."""
        reader = codec.FrameReader(request_iterator, self.timing.max_array_bytes)
        deadline = self._arm(context, self.timing.first_frame_s)
        try:
            result = reader.next_message()
        except (StopIteration, ValueError) as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad result stream: {err or 'empty'}")
        except grpc.RpcError:  # cancelled: no Result within first_frame_s
            return pb.ResultReply()
        finally:
            self._disarm(deadline)
        if not isinstance(result, pb.Result):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Ack carries a Result, not a Command")
        session = self._session(result.session, context, pb.ROLLOUT)
        forged = self._foreign_ticket(session, result)
        if forged:
            session.port.fail(forged)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, forged)
        deadline = self._arm(context, self.timing.command_timeout_s)
        try:
            arrays = reader.read_arrays(result)
        except ValueError as err:  # a bad stream from a live session: its slice is failed
            session.port.fail(f"bad result stream: {err}")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad result stream: {err}")
        except grpc.RpcError:
            session.port.fail(f"its result stream took over {self.timing.command_timeout_s:.0f}s")
            return pb.ResultReply()
        finally:
            self._disarm(deadline)
        session.port.resolve(result, arrays)
        return pb.ResultReply()

    @staticmethod
    def _foreign_ticket(session: _Session, result: pb.Result) -> str | None:
        """Why `result` cannot be relayed: an exported slot's KV ticket names an address other than
        the transfer server its slice registered (the coordinator would send other slices to it)."""
        for item in result.exported:
            if item.HasField("slot_state") and item.slot_state.HasField("kv_ticket"):
                address = item.slot_state.kv_ticket.address
                if not session.transfer_address or address != session.transfer_address:
                    return f"a KV ticket names {shown(address)}, not the transfer server the slice registered"
        return None

    def PostFinished(self, request: pb.FinishedRequest, context) -> pb.FinishedReply:
        session = self._session(request.session, context, pb.ROLLOUT)
        with self._cond:
            if request.seq <= session.finished_seq:
                return pb.FinishedReply()  # a retry of a post already applied
            skipped = request.seq != session.finished_seq + 1
            session.finished_seq = request.seq
            backend = self.backend
        if skipped:  # the worker's next real post would be taken for a retry and lost: fail it now
            session.port.fail(f"posted finished trajectories out of sequence (seq {request.seq})")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a post skipped sequence numbers; the slice is failed")
        if backend is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "finished trajectories before the coordinator started")
        try:
            trajectories = [codec.trajectory_from_proto(t) for t in request.trajectories]
        except ValueError as err:  # e.g. an unknown finish reason: the coordinator checks the rest
            session.port.fail(f"posted a trajectory that does not decode: {intake.shown(err)}")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a trajectory does not decode; the slice is failed")
        backend.post_finished(session.slice_id, trajectories)
        return pb.FinishedReply()

    # ------------------------------------------------------------------ trainer
    def TakeBatch(self, request: pb.TakeBatchRequest, context) -> pb.TakeBatchReply:
        self._session(request.session, context, pb.TRAINER)
        with self._cond:
            if self._taken is not None and self._taken[0] == request.trainer_version:
                return self._taken[1]  # the reply to this version was lost on the way: send it again
            self._cond.wait_for(lambda: self.backend is not None, timeout=_bounded_wait(request.wait_s))
            backend = self.backend
        if backend is None:
            return pb.TakeBatchReply(ready=False)
        peeked: list[Group] = []

        def peek() -> bool:  # take_batch's idle work: stop waiting once there are groups to show
            if request.peek:
                peeked.extend(backend.peek_batch(int(request.trainer_version), committed=bool(request.commit)))
            if peeked:
                raise _Peeked
            return False

        try:
            groups: list[Group] | None = backend.take_batch(
                int(request.trainer_version), timeout=_bounded_wait(request.wait_s), idle=peek
            )
        except (TimeoutError, _Peeked):
            return pb.TakeBatchReply(
                ready=False, groups=[codec.group_to_proto(g) for g in peeked], stats_json=self._stats_json(backend)
            )
        if groups is None:
            context.abort(grpc.StatusCode.ABORTED, "the coordinator has stopped (see its log)")
        reply = pb.TakeBatchReply(
            ready=True, groups=[codec.group_to_proto(g) for g in groups], stats_json=self._stats_json(backend)
        )
        with self._cond:
            self._taken = (int(request.trainer_version), reply)
        return reply

    def _stats_json(self, backend) -> str:
        stats = dataclasses.asdict(backend.stats)
        stats["versions_in_flight"] = len(backend.versions_in_flight())
        stats.update(self.worker_counters())
        return json.dumps(stats)

    def ReportPublished(self, request: pb.PublishedRequest, context) -> pb.PublishedReply:
        self._session(request.session, context, pb.TRAINER)
        version = int(request.version)
        with self._cond:
            backend = self.backend
            if backend is None:
                if self.initial_version is None:
                    self.initial_version = version
                    self._published = version
                    self._cond.notify_all()
                # Retire nothing yet: a resumed trainer has just published again the older
                # versions its checkpoint's unconsumed work needs.
                return pb.PublishedReply(oldest_needed=0)
            fresh = version > self._published
            self._published = max(self._published, version)
        if fresh:
            if request.behaviour_digests:
                backend.record_behaviour(version - 1, dict(request.behaviour_digests))
            backend.post_published(version)
        return pb.PublishedReply(oldest_needed=min(backend.versions_needed() | {version}))

    def Resume(self, request: pb.ResumeRequest, context) -> pb.ResumeReply:
        self._session(request.session, context, pb.TRAINER)
        with self._cond:
            if not self.resume:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this run is not resuming (its ledger was new)")
            if self.backend is not None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the coordinator is already running this run")
            self.resume_state = json.loads(request.state_json) if request.has_state else {}
            self._cond.notify_all()
        return pb.ResumeReply()

    def Snapshot(self, request: pb.SnapshotRequest, context) -> pb.SnapshotReply:
        """The coordinator's state once the trainer's publish of `trainer_version` is applied,
        taken by its event loop (consistent with the ledger offset it records)."""
        self._session(request.session, context, pb.TRAINER)
        with self._cond:
            backend, extra = self.backend, self._snapshot_extra
        if backend is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no snapshot before the coordinator runs")
        try:
            backend.wait_for_version(int(request.trainer_version), timeout=self.timing.command_timeout_s)
            state = backend.request_snapshot(extra).result(timeout=self.timing.command_timeout_s)
        except Exception as err:  # the trainer keeps its previous checkpoint and says why
            context.abort(grpc.StatusCode.UNAVAILABLE, f"no snapshot: {type(err).__name__}: {err}")
        return pb.SnapshotReply(state_json=json.dumps(state))

    def Evaluate(self, request: pb.EvaluateRequest, context) -> pb.EvaluateReply:
        """Starts (first call) or polls the evaluation round of `request.version`; see dora.proto."""
        self._session(request.session, context, pb.TRAINER)
        version, samples, wait_s = int(request.version), int(request.samples), _bounded_wait(request.wait_s)
        with self._cond:
            self._cond.wait_for(lambda: self.backend is not None, timeout=wait_s)
            if self.backend is None:
                return pb.EvaluateReply(ready=False)  # the coordinator starts once every role joined
            problem, future = self._eval_round(version, samples)
        if problem:
            self._log(f"refused an evaluation: {problem}")
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        try:
            result = future.result(timeout=wait_s)
        except TimeoutError:
            return pb.EvaluateReply(ready=False)
        except Exception as err:  # e.g. the coordinator refused the version: the trainer logs it
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"evaluation of version {version} failed: {err}")
        return _eval_reply(result, self._held_out.leak_counts() if self._held_out else {})

    def _eval_round(self, version: int, samples: int) -> tuple[str | None, Future | None]:
        """(why not, None) or (None, the round's future), started here on the first call for
        `version`: it must be the newest version the trainer published, and ask no more samples
        than the config allows. Caller holds self._cond."""
        held_out = self._held_out
        if held_out is None:
            return "this run evaluates nothing (eval.every_steps is 0 at the coordinator)", None
        if version in self._evals:
            asked, future = self._evals[version]
            if samples != asked:
                return f"the round of version {version} was asked with samples={asked}, not {samples}", None
            return None, future
        if version != self._published:
            return f"version {version} is not the newest version the trainer published", None
        if not 0 <= samples <= held_out.max_samples:
            return f"samples={samples}; expected 0..{held_out.max_samples} (eval.samples)", None
        if sum(not f.done() for _, f in self._evals.values()) >= MAX_EVAL_ROUNDS:
            return f"{MAX_EVAL_ROUNDS} evaluation rounds are unfinished already; ask again later", None
        future = self.backend.request_eval(version, version, held_out.prompts, samples)
        self._evals[version] = (samples, future)
        done = sorted(v for v, (_, f) in self._evals.items() if f.done())
        for old in done[: max(0, len(self._evals) - MAX_EVAL_ROUNDS)]:
            del self._evals[old]  # a finished round is kept for a retried poll while few are kept
        return None, future

    def Finish(self, request: pb.FinishRequest, context) -> pb.FinishReply:
        self._session(request.session, context, pb.TRAINER)
        with self._cond:
            backend, published = self.backend, self._published
        if backend is not None:  # the last publish is in the ledger before the loop stops
            backend.wait_for_version(published, timeout=self.timing.command_timeout_s)
        self._log("the trainer has finished its steps")
        self.finished.set()
        return pb.FinishReply()


def make_server(
    service: CoordinatorService,
    port: int,
    *,
    host: str = "[::]",
    max_workers: int | None = None,
    auth: auth.Authenticator | None = None,
    tls: auth.ServerTls | None = None,
):
    """A started gRPC server for `service` on `host:port` (port 0 picks one); returns (server, port).

    Every call passes the guard (dora_jax/transport/guard.py): with `auth` it checks role tokens
    (the role processes always pass one; in-process tests may not), and always the request sizes
    and calls in flight. Threads: what the long-lived calls can hold (command streams, result
    streams, long-polls: bounded per caller by the guard) plus SHORT_CALL_THREADS for the short
    ones; `maximum_concurrent_rpcs` equals the pool, so a call is refused (RESOURCE_EXHAUSTED)
    rather than queued behind busy threads. `tls`: serve TLS with that certificate and key."""
    from concurrent.futures import ThreadPoolExecutor

    workers = max_workers or guard.long_call_threads(service.identity.num_slices) + guard.SHORT_CALL_THREADS
    server = grpc.server(
        ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc"),
        interceptors=[guard.Guard(auth, service.identity.num_slices, log=service._log)],
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
        maximum_concurrent_rpcs=workers,
    )
    pb_grpc.add_CoordinatorServicer_to_server(service, server)
    address = f"{host}:{port}"
    if tls is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, grpc.ssl_server_credentials([(tls.key_pem, tls.cert_pem)]))
    if bound == 0:
        raise OSError(f"cannot listen on {address} (in use?)")
    server.start()
    return server, bound


def _bounded_wait(wait_s: float) -> float:
    """A client's long-poll window, in 0..MAX_WAIT_S (NaN or negative: 0)."""
    return min(float(wait_s), MAX_WAIT_S) if wait_s > 0 else 0.0


def _eval_reply(result: dict, leak_counts: dict) -> pb.EvaluateReply:
    """A finished round (dora_jax.coordinator.evaluation's result) as an EvaluateReply."""
    summary = {k: v for k, v in result.items() if k != "responses"}
    summary.update(leak_counts)
    responses = [
        pb.ScoredTrajectory(
            trajectory=codec.trajectory_to_proto(traj),
            reward=reward,
            has_reward_error=error is not None,
            reward_error=error or "",
        )
        for traj, reward, error in result["responses"]
    ]
    return pb.EvaluateReply(ready=True, summary_json=json.dumps(summary), responses=responses)


def _principal(role: int, slice_id: int) -> auth.Principal | None:
    """The principal a session or registration of `role` (and slice) belongs to."""
    if role == pb.TRAINER:
        return auth.TRAINER
    return auth.rollout(slice_id) if role == pb.ROLLOUT else None


def hostname() -> str:
    return socket.gethostname()
