"""The in-process transport: a RolloutWorker on its own thread behind the `RolloutPort` seam.

The thread alternates between the commands in its inbox (submit, load a version, export,
import) and one `worker.step()`; finished trajectories go to the coordinator's inbox. Commands
are answered through futures, so a coordinator call returns once the worker has done it, and a
trajectory that finished before an export is already posted when the export returns. A worker
that raises stops its thread and keeps the error; the runner reports it (and a heartbeat that
stops, `last_beat`) to the coordinator as a failed slice.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from dora_jax.coordinator.ports import PortError
from dora_jax.core.records import Reprefill, Request, SlotState
from dora_jax.rollout.worker import RolloutWorker, export_from, import_into


class SliceError(PortError):
    def __init__(self, slice_id: int, error: BaseException):
        super().__init__(f"rollout slice {slice_id} failed: {type(error).__name__}: {error}")
        self.slice_id = slice_id


class WorkerThread:
    """Implements dora_jax.coordinator.ports.RolloutPort for one in-process RolloutWorker."""

    def __init__(
        self,
        worker: RolloutWorker,
        fetch_params: Callable[[int], object],
        post_finished,
        *,
        command_timeout_s: float = 600.0,
    ):
        self.worker = worker
        self.slice_id = worker.slice_id
        self.num_slots = worker.num_slots
        self._fetch_params = fetch_params  # version -> params laid out for this slice
        self._post_finished = post_finished
        self._timeout = command_timeout_s
        self._inbox: queue.Queue[tuple[Callable, Future]] = queue.Queue()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.last_beat = time.monotonic()  # heartbeat: refreshed every loop turn
        self._fault: BaseException | None = None
        self.busy_s = 0.0  # wall time spent inside worker.step()
        self.timeline: list[tuple[float, float, int | None, float]] = []  # (start, end, version, occupancy) per step
        self._thread = threading.Thread(target=self._loop, name=f"rollout-{self.slice_id}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ RolloutPort
    def submit(self, requests: Sequence[Request]) -> None:
        self._call(lambda: [self.worker.submit(r) for r in requests])

    def load_version(self, version: int) -> str:
        """Returns the loaded params' digest."""
        params = self._fetch_params(version)  # outside the worker thread: decoding goes on meanwhile
        return self._call(lambda: self.worker.load_version(version, params))

    def export(self, traj_ids: Sequence[str], kv: bool = True) -> list[SlotState | Reprefill | Request]:
        # KV rows stay on the devices: the importing slice copies them device to device.
        return self._call(lambda: export_from(self.worker, traj_ids, to_host=False, kv=kv))

    def progress(self) -> dict[str, Request]:
        return self._call(self.worker.progress)

    def import_(self, items: Sequence[SlotState | Request]) -> None:
        self._call(lambda: import_into(self.worker, items))

    # ------------------------------------------------------------------ thread
    def _call(self, fn: Callable):
        if self.error is not None:
            raise SliceError(self.slice_id, self.error)
        future: Future = Future()
        self._inbox.put((fn, future))
        try:
            return future.result(timeout=self._timeout)
        except TimeoutError:
            raise SliceError(self.slice_id, TimeoutError(f"no answer within {self._timeout}s (hung?)")) from None

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self.last_beat = time.monotonic()
                if self._fault is not None and self.worker.num_active:  # strike mid-generation
                    if self._fault == "hang":
                        while not self._stop.is_set():  # no heartbeat, no answers: a hung worker
                            time.sleep(0.05)
                        return
                    raise self._fault
                self._run_commands(block=not self.worker.has_work)
                if self.worker.has_work:
                    start = time.perf_counter()
                    active = self.worker.num_active / self.num_slots
                    finished = self.worker.step()
                    end = time.perf_counter()
                    self.busy_s += end - start
                    self.timeline.append((start, end, self.worker.version, active))
                    if finished and not self._stop.is_set():
                        self._post_finished(self.slice_id, finished)
        except BaseException as err:  # surfaced by the runner with the slice id
            self.error = err
            self._fail_pending(err)

    def _run_commands(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.01) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, future = item
            try:
                future.set_result(fn())
            except BaseException as err:
                future.set_exception(err)
                raise
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                item = None

    def _fail_pending(self, err: BaseException) -> None:
        while True:
            try:
                _, future = self._inbox.get_nowait()
            except queue.Empty:
                return
            future.set_exception(SliceError(self.slice_id, err))

    def inject_failure(self, error: BaseException | str) -> None:
        """Fault injection: at its next turn the thread raises `error` as a crashing worker would,
        or, for "hang", stops answering and beating as a hung one would."""
        self._fault = error

    @property
    def alive(self) -> bool:
        """Whether the thread still runs (a worker hung inside a step holds its engine)."""
        return self._thread.is_alive()

    def abandon(self, reason: str = "missed its heartbeat") -> None:
        """Gives up on this worker (hung, or dropped by the coordinator): pending and later
        commands fail, it decodes and posts nothing more, and its thread exits at its next turn."""
        self.error = self.error or TimeoutError(f"slice {self.slice_id} {reason}")
        self._post_finished = lambda *_: None
        self._stop.set()
        self._fail_pending(self.error)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
