"""A rollout slice over several hosts: one multi-controller JAX job whose hosts issue the same calls.

Under multi-controller SPMD every host of a slice must run the same jitted computations in the
same order, but only host 0 (the leader) talks to the coordinator. So the leader's RolloutWorker
is wrapped in a `MirroredWorker`: every call that changes the slice's state or runs a computation
(fetch a version, load it, warm up, submit, take queued, export, import, step, stop) is first sent
to the other hosts (`HostChannel`, a broadcast through a JAX collective), then run locally. Each
follower runs `follow()`: it applies the same commands to its own RolloutWorker, in the same
order, so its host-side scheduling (queue, slots, finish reasons) and so its computations match
the leader's exactly. What leaves the slice (finished trajectories, exported KV slot states) is
the leader's; the followers' copies are dropped.

Reading a host-local view is free (the leader's own worker); `progress()` changes nothing and is
not mirrored. Before anything else `check_same_slice` compares every host's identity (config
digest, package version, slice id, host count) and fails on all hosts with the same message.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import pickle
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from dora_jax.core.records import Request, SlotState, Trajectory
from dora_jax.rollout.worker import RolloutWorker, WorkerCounters

_HEAD_BYTES = 4096  # one collective carries a command this small (all but imports and big submits)
_LENGTH_BYTES = 8
_IDENTITY_BYTES = 1024


class Op(enum.Enum):
    FETCH = "fetch"  # read a version from the ParamStore onto the slice's mesh (every host its shards)
    WARMUP = "warmup"  # compile every engine program with a fetched version
    LOAD = "load"  # worker.load_version with the fetched params
    SUBMIT = "submit"
    TAKE_QUEUED = "take_queued"
    EXPORT = "export"
    RELEASE = "release"
    IMPORT = "import"
    STEP = "step"
    STOP = "stop"


@dataclasses.dataclass(frozen=True)
class Command:
    """One call the leader made, as every host replays it."""

    op: Op
    args: tuple = ()


class HostChannel:
    """Bytes from host 0 to every host of this JAX job, through `broadcast_one_to_all`.

    Every host must call `exchange` the same number of times (host 0 with the payload, the others
    with None). A message is one fixed-size collective (length + the first bytes) plus, when it is
    longer, one more of a power-of-two size: a bounded number of compiled programs.
    """

    def __init__(self):
        self.is_leader = jax.process_index() == 0

    def send(self, payload: bytes) -> None:
        if not self.is_leader:
            raise RuntimeError(f"host {jax.process_index()} cannot send: only host 0 leads the slice")
        self.exchange(payload)

    def receive(self) -> bytes:
        return self.exchange(None)

    def exchange(self, payload: bytes | None) -> bytes:
        head = np.zeros((_HEAD_BYTES,), np.uint8)
        if self.is_leader:
            head[:_LENGTH_BYTES] = np.frombuffer(len(payload).to_bytes(_LENGTH_BYTES, "little"), np.uint8)
            first = payload[: _HEAD_BYTES - _LENGTH_BYTES]
            head[_LENGTH_BYTES : _LENGTH_BYTES + len(first)] = np.frombuffer(first, np.uint8)
        head = np.asarray(multihost_utils.broadcast_one_to_all(head))
        length = int.from_bytes(head[:_LENGTH_BYTES].tobytes(), "little")
        data = head[_LENGTH_BYTES : _LENGTH_BYTES + length].tobytes()
        rest = length - len(data)
        if rest > 0:
            tail = np.zeros((1 << (rest - 1).bit_length(),), np.uint8)
            if self.is_leader:
                tail[:rest] = np.frombuffer(payload[len(data) :], np.uint8)
            data += np.asarray(multihost_utils.broadcast_one_to_all(tail))[:rest].tobytes()
        return data


def check_same_slice(identity: dict) -> None:
    """Every host of the job compares its `identity` (flat JSON-able dict) with host 0's; a host
    that differs fails everywhere with a message naming the host and the differing fields."""
    encoded = json.dumps(identity, sort_keys=True).encode()
    if len(encoded) > _IDENTITY_BYTES:
        raise ValueError(f"slice identity is {len(encoded)} bytes; at most {_IDENTITY_BYTES}")
    buffer = np.zeros((_IDENTITY_BYTES,), np.uint8)
    buffer[: len(encoded)] = np.frombuffer(encoded, np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(buffer))
    identities = [json.loads(row.tobytes().rstrip(b"\0")) for row in gathered]
    for host, other in enumerate(identities[1:], start=1):
        differ = sorted(k for k in identities[0].keys() | other.keys() if identities[0].get(k) != other.get(k))
        if differ:
            detail = ", ".join(
                f"{k}: host 0 has {identities[0].get(k)!r}, host {host} has {other.get(k)!r}" for k in differ
            )
            raise SystemExit(
                f"the hosts of one slice disagree ({detail}); start every host of a slice with the "
                "same --config, overrides, --slice_id and --num_hosts"
            )


def _encode(command: Command) -> bytes:
    # pickle: the payload never leaves this JAX job's own hosts, which run the same code.
    return pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)


def _decode(payload: bytes) -> Command:
    return pickle.loads(payload)


class MirroredWorker:
    """Host 0's RolloutWorker: the RolloutWorker calls the agent makes, each sent to every other
    host of the slice before it runs here. `fetch_params(version)` reads a version onto the mesh."""

    def __init__(self, worker: RolloutWorker, channel: HostChannel, fetch_params: Callable[[int], Any]):
        if not channel.is_leader:
            raise ValueError("MirroredWorker runs on host 0 only; the other hosts run follow()")
        self._worker = worker
        self._channel = channel
        self._fetch_params = fetch_params
        self._stopped = False

    def _send(self, op: Op, *args) -> None:
        if self._stopped:
            raise RuntimeError(f"slice {self._worker.slice_id}: the other hosts were already told to stop")
        self._channel.send(_encode(Command(op, args)))

    # ------------------------------------------------------------------ host-local views
    @property
    def slice_id(self) -> int:
        return self._worker.slice_id

    @property
    def num_slots(self) -> int:
        return self._worker.num_slots

    @property
    def version(self) -> int | None:
        return self._worker.version

    @property
    def active_traj_ids(self) -> tuple[str, ...]:
        return self._worker.active_traj_ids

    @property
    def queued_traj_ids(self) -> tuple[str, ...]:
        return self._worker.queued_traj_ids

    @property
    def has_work(self) -> bool:
        return self._worker.has_work

    @property
    def counters(self) -> WorkerCounters:
        return self._worker.counters

    def progress(self) -> dict[str, Request]:
        return self._worker.progress()

    # ------------------------------------------------------------------ mirrored calls
    def fetch(self, version: int):
        """The version's params on the slice's mesh (every host reads its own shards)."""
        self._send(Op.FETCH, int(version))
        return self._fetch_params(int(version))

    def warmup(self, version: int) -> None:
        """Compiles every engine program on every host with `version`'s params."""
        self._send(Op.WARMUP, int(version))
        self._worker.engine.warmup(self._fetch_params(int(version)))

    def load_version(self, version: int, params, *, allow_active: bool = False) -> str:
        self._send(Op.LOAD, int(version), allow_active)
        return self._worker.load_version(version, params, allow_active=allow_active)

    def submit(self, request: Request) -> None:
        self._send(Op.SUBMIT, request)
        self._worker.submit(request)

    def take_queued(self, traj_ids: Iterable[str] | None = None) -> list[Request]:
        traj_ids = None if traj_ids is None else tuple(traj_ids)
        self._send(Op.TAKE_QUEUED, traj_ids)
        return self._worker.take_queued(traj_ids)

    def migration_choice(self, traj_id: str, *, to_host: bool = True) -> str:
        return self._worker.migration_choice(traj_id, to_host=to_host)

    def export_requests(self, traj_ids: Iterable[str] | None = None, *, to_host: bool = True) -> list[SlotState]:
        traj_ids = None if traj_ids is None else tuple(traj_ids)
        self._send(Op.EXPORT, traj_ids, to_host)
        return self._worker.export_requests(traj_ids, to_host=to_host)

    def release_requests(self, traj_ids: Iterable[str]) -> list[Request]:
        traj_ids = tuple(traj_ids)
        self._send(Op.RELEASE, traj_ids)
        return self._worker.release_requests(traj_ids)

    def import_requests(self, states: Sequence[SlotState]) -> None:
        self._send(Op.IMPORT, tuple(states))
        self._worker.import_requests(states)

    def step(self) -> list[Trajectory]:
        self._send(Op.STEP)
        return self._worker.step()

    def stop(self, reason: str) -> None:
        """Ends `follow()` on every other host; idempotent."""
        if not self._stopped:
            self._send(Op.STOP, reason)
            self._stopped = True


def follow(
    worker: RolloutWorker,
    channel: HostChannel,
    fetch_params: Callable[[int], Any],
    *,
    log: Callable[[str], None] = print,
) -> str:
    """A follower host's loop: replays every command host 0 sends on `worker` until STOP; returns
    the leader's reason. A command that fails here failed identically on host 0 (same state, same
    inputs), which decides what happens next; the follower logs it and goes on."""
    if channel.is_leader:
        raise ValueError("follow() runs on the hosts other than host 0")
    fetched: dict[int, Any] = {}
    while True:
        command = _decode(channel.receive())
        if command.op is Op.STOP:
            return command.args[0]
        try:
            _apply(worker, command, fetched, fetch_params)
        except Exception as err:  # noqa: BLE001 - mirrored from the leader, which reports it
            log(f"{command.op.value} failed as on host 0: {type(err).__name__}: {err}")


def _apply(worker: RolloutWorker, command: Command, fetched: dict, fetch_params) -> None:
    op, args = command.op, command.args
    if op is Op.FETCH:
        fetched.clear()  # the leader loads what it fetched before it fetches again
        fetched[args[0]] = fetch_params(args[0])
    elif op is Op.WARMUP:
        worker.engine.warmup(fetch_params(args[0]))
    elif op is Op.LOAD:
        version, allow_active = args
        worker.load_version(version, fetched.pop(version), allow_active=allow_active)
    elif op is Op.SUBMIT:
        worker.submit(args[0])
    elif op is Op.TAKE_QUEUED:
        worker.take_queued(args[0])
    elif op is Op.EXPORT:
        worker.export_requests(args[0], to_host=args[1])
    elif op is Op.RELEASE:
        worker.release_requests(args[0])
    elif op is Op.IMPORT:
        worker.import_requests(args[0])
    elif op is Op.STEP:
        worker.step()
    else:
        raise ValueError(f"unknown mirrored command {op}")
