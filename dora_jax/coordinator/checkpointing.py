"""The coordinator's checkpoints: its state as JSON at a moment consistent with the ledger, and a
resumed run's start from it (`Coordinator` inherits these; the JSON's shape is snapshot.py's).

A mixin over the Coordinator's state: `snapshot` and `restore` take its lock, and `snapshot` calls
the ports (only the loop thread may: another thread uses `Coordinator.request_snapshot`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future

from dora_jax.coordinator import events, snapshot
from dora_jax.core.records import Request


class Checkpoints:
    def request_snapshot(self, extra: Callable[[], dict] | None = None) -> Future[dict]:
        """`snapshot()` taken by the loop thread (it calls the ports); for other threads."""
        future: Future = Future()
        self._inbox.put(events.SnapshotRequested(extra, future))
        return future

    def live_prompt_ids(self) -> set[str]:
        """The prompts that in-flight and queued requests and trajectories awaiting a reward refer
        to (what a checkpoint must carry; `resume.PromptBook` forgets the rest). For the callbacks
        the coordinator runs under its lock (`next_prompt`, a snapshot's `extra`): it takes none."""
        live = {r.prompt_id for r in self.requests.values()} | {r.prompt_id for r in self.backlog}
        return live | {t.prompt_id for t in self._rewards.unscored.values()}

    def snapshot(self, extra: Callable[[], dict] | None = None) -> dict:
        """The coordinator's state as JSON, consistent with the ledger's first `ledger_offset`
        lines. In-flight requests carry their tokens so far (the ports' `progress`) as a prefix;
        finished groups, partly scored groups and trajectories awaiting a reward are kept whole.
        `extra()` runs under the same lock (the prompt source's position: it advances only here).
        It calls the ports: only the thread that runs `process()` may call it; any other thread
        uses `request_snapshot()`."""
        with self._cond:
            return self._snapshot(extra)

    def _snapshot(self, extra: Callable[[], dict] | None) -> dict:
        self._absorb()
        progress: dict[str, Request] = {}
        for sid in list(self.ports):
            if hasattr(self.ports[sid], "progress"):
                progress.update(self._port_call(sid, "progress", default={}) or {})
        # Nothing below releases the lock: the state and the ledger offset are read together.
        self.ledger.flush()  # the offset counts only lines in the file
        extra_state = extra() if extra else {}
        # Evaluation requests are not saved: a round in flight at a checkpoint is lost with the process.
        evals = self._evaluation
        saved = snapshot.Saved(
            latest=self.latest,
            next_group=self._groups.next_id,
            next_eval=evals.next_round,
            dispatched=snapshot.with_progress(self.requests, progress, skip=evals),
            backlog=[r for r in self.backlog if r.traj_id not in evals],
            redispatch=sorted(t for t in self._redispatch if t not in evals),
            groups=self.groups,
            unscored=[t for k, t in self._rewards.unscored.items() if k not in evals],
            queue=self.queue.peek_oldest(len(self.queue)),
            stats=self.stats,
            ledger_offset=self.ledger.lines_written,
            extra=extra_state,
            filtered_since_take=self._filter_budget.since_take,
        )
        return snapshot.to_json(saved)

    def restore(self, state: dict | None) -> None:
        """Continues from `snapshot()`, before `start()` and with nothing loaded on the slices:
        writes the ledger's `resume` event (voiding what the lost process wrote after the
        snapshot), re-dispatches in-flight requests under their own version, re-scores. With no
        state (a run that died before its first checkpoint) everything before is voided."""
        with self._cond:
            if state is None:
                self._write_resume(0, (), 0, 0)
                return
            saved = snapshot.from_json(state)
            self.latest = saved.latest
            self._taken_at = self.latest  # not known: assume taken, the smaller window (never more than C3 allows)
            self._evaluation.next_round = saved.next_eval
            self._groups.restore(saved.groups, saved.next_group)
            for group in saved.queue:
                self.queue.put(group)
            self.stats = saved.stats
            self._filter_budget.since_take = saved.filtered_since_take
            self.backlog = [*saved.dispatched, *saved.backlog]
            self._redispatch = set(saved.redispatch) | {r.traj_id for r in saved.dispatched}
            self._write_resume(
                saved.ledger_offset, saved.dispatched, len(saved.backlog), len(self.queue) + len(self.groups)
            )
            for traj in saved.unscored:
                self._rewards.submit(traj)

    def _write_resume(self, ledger_offset: int, dispatched: Sequence[Request], backlog: int, groups: int) -> None:
        """The ledger's `resume` event (`groups`: how many are unconsumed): it voids what the lost
        process wrote after `ledger_offset`."""
        self.ledger.write(
            "resume",
            ledger_offset=ledger_offset,
            version=self.latest,
            in_flight=len(dispatched),
            backlog=backlog,
            unconsumed_groups=groups,
            prefix_tokens=sum(len(r.prefix_response_ids) for r in dispatched),
        )
