"""`GrpcRolloutPort`: the coordinator's RolloutPort for one remote rollout worker.

Each call becomes a Command queued to that worker's command stream (served by
`CoordinatorService.Commands`); the call blocks until the worker's Result for it arrives (through
`CoordinatorService.Ack`) or `command_timeout_s` passes. A port whose worker is gone (stream
broken, heartbeats missed, a call past its deadline, a command the worker failed) is failed once:
every pending and later call raises `PortError`, and `on_fail(port, reason)` tells the
coordinator (`post_slice_failed`), which re-dispatches what the slice held. So the same
Coordinator runs unchanged behind this port and the in-process `WorkerThread`.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent import futures

import numpy as np

from dora_jax.coordinator.ports import PortError
from dora_jax.core.records import Request, SlotState
from dora_jax.transport import codec
from dora_jax.transport import dora_pb2 as pb


class GrpcRolloutPort:
    """Implements dora_jax.coordinator.ports.RolloutPort over the command stream of one session."""

    def __init__(
        self,
        slice_id: int,
        num_slots: int,
        session: str,
        *,
        command_timeout_s: float,
        on_fail: Callable[[GrpcRolloutPort, str], None],
    ):
        self.slice_id = slice_id
        self.num_slots = num_slots
        self.session = session
        self._timeout = command_timeout_s
        self._on_fail = on_fail
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._pending: dict[int, futures.Future] = {}
        self._outbox: queue.Queue[tuple[pb.Command, list[np.ndarray]]] = queue.Queue()
        self.failure: str | None = None
        self.connected = threading.Event()  # the worker's command stream is open
        self.stopping = False  # a Stop was queued: the stream's end is expected

    # ------------------------------------------------------------------ RolloutPort
    def submit(self, requests: Sequence[Request]) -> None:
        self._call(pb.Command(submit=pb.Submit(requests=[codec.request_to_proto(r) for r in requests])), [])

    def load_version(self, version: int) -> str | None:
        """Returns the digest of the params the worker loaded (None from a worker that sends none)."""
        result, _ = self._call(pb.Command(load_version=pb.LoadVersion(version=int(version))), [])
        return result.digest or None

    def export(self, traj_ids: Sequence[str], kv: bool = True) -> list:
        export = pb.Export(traj_ids=list(traj_ids), without_kv=not kv)
        result, arrays = self._call(pb.Command(export=export), [])
        return codec.migratables_from_proto(result.exported, iter(arrays))

    def import_(self, items: Sequence[SlotState | Request]) -> list[str]:
        """Returns the ids the worker re-prefilled instead of pulling their KV rows."""
        messages, arrays = codec.migratables_to_proto(items)
        result, _ = self._call(pb.Command(import_items=pb.Import(items=messages)), arrays)
        return list(result.reprefilled)

    def progress(self) -> dict[str, Request]:
        """Every request on the slice as a Request carrying its tokens so far, the slice untouched."""
        result, _ = self._call(pb.Command(progress=pb.Progress()), [])
        return {r.traj_id: r for r in map(codec.request_from_proto, result.progress)}

    # ------------------------------------------------------------------ coordinator side
    def _call(self, command: pb.Command, arrays: list[np.ndarray]) -> tuple[pb.Result, list[np.ndarray]]:
        kind = command.WhichOneof("kind")
        with self._lock:
            if self.failure is not None:
                raise PortError(f"rollout slice {self.slice_id} is gone ({self.failure}); {kind} not sent")
            command.id = next(self._ids)
            future: futures.Future = futures.Future()
            self._pending[command.id] = future
        self._outbox.put((command, arrays))
        try:
            result, result_arrays = future.result(timeout=self._timeout)
        except futures.TimeoutError:
            reason = f"no result for {kind} (command {command.id}) within {self._timeout:.0f}s"
            self.fail(reason)
            raise PortError(f"rollout slice {self.slice_id}: {reason}") from None
        if result.error:
            reason = f"worker failed {kind}: {result.error}"
            self.fail(reason)
            raise PortError(f"rollout slice {self.slice_id}: {reason}")
        return result, result_arrays

    def stop(self, reason: str) -> None:
        """Asks the worker to exit (end of run); no result is awaited."""
        self.stopping = True
        self._outbox.put((pb.Command(stop=pb.Stop(reason=reason)), []))

    def fail(self, reason: str) -> bool:
        """Marks the worker gone (once): pending calls raise PortError, the coordinator is told.
        Returns whether this call did it."""
        with self._lock:
            if self.failure is not None:
                return False
            self.failure = reason
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future.set_exception(PortError(f"rollout slice {self.slice_id} is gone: {reason}"))
        self._on_fail(self, reason)
        return True

    # ------------------------------------------------------------------ service side
    def next_frames(self, timeout: float, chunk_bytes: int) -> list[pb.Frame] | None:
        """The frames of the next queued command, or None if none came within `timeout`."""
        try:
            command, arrays = self._outbox.get(timeout=timeout)
        except queue.Empty:
            return None
        return list(codec.to_frames(command, arrays, chunk_bytes))

    def resolve(self, result: pb.Result, arrays: list[np.ndarray]) -> None:
        """The worker's answer to one command; a repeated (retried) answer is ignored."""
        with self._lock:
            future = self._pending.pop(result.command_id, None)
        if future is not None:
            future.set_result((result, arrays))
