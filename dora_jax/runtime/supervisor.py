"""Slice supervision for the embedded run: heartbeats, drops, restarts and rejoins.

Runs on the coordinator's loop thread, between `Coordinator.process()` calls. A worker thread
that raised or stopped beating is reported (`post_slice_failed`); the coordinator then drops the
slice and tells `dropped()`, as it does for a slice it found dead itself (a port call that failed
or timed out, a store error while loading). Every dropped slice is treated alike: its worker is
abandoned (it decodes and posts nothing more, for its requests are re-dispatched), the drop is
logged, and once the old thread has exited (a worker hung inside a step still holds its engine,
and is never replaced while it does) a fresh worker on the slice's engine rejoins with nothing
loaded, up to `max_rejoins` times per slice. `dropped()` tells the coordinator whether the slice
will come back, so that with every slice down at once the run waits for the restarts; one whose
hung thread still holds its engine after GIVE_UP_HEARTBEATS heartbeat timeouts is given up on.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


# A dropped slice whose hung thread still holds its engine after this many heartbeat timeouts is
# given up on (the coordinator stops waiting for it).
GIVE_UP_HEARTBEATS = 10


class SliceSupervisor:
    def __init__(
        self,
        coordinator,
        threads: dict,
        start_slice: Callable[[int], object],
        *,
        heartbeat_timeout_s: float,
        max_rejoins: int,
        restart_delay_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`threads`: slice id -> WorkerThread, updated in place on restarts; `start_slice(sid)`
        starts a fresh worker thread for the slice."""
        self._coord = coordinator
        self.threads = threads
        self.all_threads = list(threads.values())  # every thread ever started (counters, timelines)
        self._start_slice = start_slice
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._max_rejoins = max_rejoins
        self._restart_delay_s = restart_delay_s
        self._clock = clock
        self._dropped: queue.SimpleQueue[tuple[int, str]] = queue.SimpleQueue()
        self._reported: set[int] = set()  # posted as failed, not dropped yet
        self._down: set[int] = set()  # dropped, not rejoined
        self._restart_at: dict[int, float] = {}
        self._held_since: dict[int, float] = {}  # dropped, its hung thread still holds the engine
        self.rejoins: dict[int, int] = {}
        self.drops: list[tuple[int, str]] = []

    def dropped(self, slice_id: int, reason: str) -> bool:
        """The coordinator's `on_slice_dropped`: runs inside `process()`, so only queues it; True
        when the slice will be started again (`rollout.max_rejoins` not reached)."""
        self._dropped.put((slice_id, reason))
        return self.rejoins.get(slice_id, 0) < self._max_rejoins

    def check(self) -> None:
        """One supervision turn: report dead or silent workers, handle drops, restart."""
        now = self._clock()
        for sid, thread in list(self.threads.items()):
            if sid in self._reported or sid in self._down:
                continue
            hung = thread.error is None and now - thread.last_beat > self._heartbeat_timeout_s
            if thread.error is None and not hung:
                continue
            self._reported.add(sid)
            reason = (
                f"{type(thread.error).__name__}: {thread.error}"
                if thread.error is not None
                else f"TimeoutError: no heartbeat for {self._heartbeat_timeout_s:.0f}s"
            )
            self._coord.post_slice_failed(sid, reason)
        while not self._dropped.empty():
            self._on_dropped(*self._dropped.get(), now)
        for sid, when in list(self._restart_at.items()):
            if now >= when:
                self._restart(sid, now)

    def _on_dropped(self, sid: int, reason: str, now: float) -> None:
        self._reported.discard(sid)
        self._down.add(sid)
        self.drops.append((sid, reason))
        self.threads[sid].abandon(f"was dropped ({reason})")
        if self.rejoins.get(sid, 0) < self._max_rejoins:
            log.warning("rollout slice %d dropped (%s); restarting it", sid, reason)
            self._restart_at[sid] = now + self._restart_delay_s
        else:
            log.warning(
                "rollout slice %d dropped (%s); not restarted: rollout.max_rejoins=%d reached",
                sid,
                reason,
                self._max_rejoins,
            )

    def _restart(self, sid: int, now: float) -> None:
        if self.threads[sid].alive:  # hung inside a step: its engine is not free yet
            since = self._held_since.setdefault(sid, now)
            if now - since < GIVE_UP_HEARTBEATS * self._heartbeat_timeout_s:
                self._restart_at[sid] = now + self._restart_delay_s
                return
            del self._restart_at[sid]  # the coordinator stops counting on it (the run may end)
            why = f"not restarted: its hung thread held the engine for {now - since:.0f}s"
            log.warning("rollout slice %d %s", sid, why)
            self._coord.post_slice_wont_rejoin(sid, why)
            return
        self._held_since.pop(sid, None)
        del self._restart_at[sid]
        self.rejoins[sid] = self.rejoins.get(sid, 0) + 1
        self.threads[sid] = thread = self._start_slice(sid)
        self.all_threads.append(thread)
        self._down.discard(sid)
        self._coord.post_slice_joined(thread)
