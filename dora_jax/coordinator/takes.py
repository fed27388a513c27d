"""The trainer's side of the coordinator: the take of a batch under the version window (C3),
what the trainer may work on while it waits (peeks and commitments), and the wait itself
(`Coordinator` inherits these).

A mixin over the Coordinator's state. Every method runs on the trainer's thread (in a process
placement, the gRPC handler's); none calls a port. What follows a
take (supply, switching) runs on the loop: a take posts `events.Taken`.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Mapping

from dora_jax.coordinator import events
from dora_jax.core.records import Group, Trajectory
from dora_jax.core.window import window_allows


class TrainerSide:
    def record_behaviour(self, step: int, digests: Mapping[int, str]) -> None:
        """Ledger: the params (by digest) the trainer used at `step` to recompute behaviour
        log-probs, per version, so the audit can match them with what the slices loaded."""
        self.ledger.write("behaviour", step=int(step), digests={str(v): d for v, d in sorted(digests.items())})

    def wait_for_version(self, version: int, timeout: float = 60.0) -> None:
        """Blocks until the publish of `version` has been applied (the event loop runs it)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.latest < version:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"coordinator did not apply the publish of version {version} within {timeout}s")
                self._cond.wait(0.05)

    def try_take_batch(self, trainer_version: int) -> list[Group] | None:
        """TBS samples, oldest version first, if the version window lets the trainer advance from
        `trainer_version` to `trainer_version + 1`; None otherwise. Caller holds no lock."""
        return self._try_take(trainer_version)[0]

    def _try_take(self, trainer_version: int) -> tuple[list[Group] | None, str]:
        """`try_take_batch`, and why it took nothing: "publish" (the trainer's last publish is not
        applied yet), "results" (fewer than a batch of whole groups queued) or "c3" (C3 holds a
        queued batch: older samples still decoding would be too stale after it)."""
        with self._cond:
            if trainer_version != self.latest:
                return None, "publish"  # its publish is still in the inbox: supplies would use a stale version
            need = self.config.train_batch_size // self.config.group_size
            if len(self.queue) < need:
                return None, "results"
            rest = self._groups.unconsumed_by_version(itertools.islice(self.queue.versions(), need, None))
            if not window_allows(rest, trainer_version, self.config.window, self.config.train_batch_size):
                return None, "c3"  # older trajectories are still unconsumed: wait for them (never drop them)
            batch = self.queue.take_oldest(need)
            self._peeked.difference_update(s.trajectory.traj_id for g in batch for s in g.samples)
            if self._committed[0] == trainer_version:
                self.stats.commitments_broken += len(self._committed[1] - {g.group_id for g in batch})
            self._committed = (-1, set())
            self._taken_at = trainer_version
            self._filter_budget.taken()
            for group in batch:
                for sample in group.samples:
                    self.ledger.write(
                        "consume",
                        traj=sample.trajectory.traj_id,
                        group=group.group_id,
                        version=sample.trajectory.version,
                        step=trainer_version,
                        trainer_version=trainer_version,
                        **_behaviour_source(sample.trajectory, self.config.behaviour_logps),
                    )
                    self.stats.consumed += 1
            self._inbox.put(events.Taken(trainer_version))  # supply and switching follow on the loop
            return batch, ""

    def peek_batch(self, trainer_version: int, committed: bool = False) -> list[Group]:
        """What the trainer can work on while it waits for the batch of `trainer_version`
        (`trainer.score_ahead`): finished samples it will train on that no peek has shown yet,
        oldest version first (the whole groups in the TransferQueue, then the samples a group still
        decoding has finished), at most a train batch of them, as groups. A peek writes nothing to
        the ledger and takes nothing; each sample is shown once (a reply lost on the way leaves
        its rows to the step's recompute). [] while the trainer's last publish is in the inbox.
        `committed` (`trainer.grad_ahead`): only whole queued groups committed to that batch
        (`_commit`), each shown once."""
        with self._cond:
            if trainer_version != self.latest:
                return []
            if committed:
                return self._commit(trainer_version)
            queued = []
            for group in self.queue.peek_oldest(len(self.queue)):
                fresh = tuple(s for s in group.samples if s.trajectory.traj_id not in self._peeked)
                if fresh:
                    queued.append(dataclasses.replace(group, samples=fresh))
            candidates = sorted(queued + self._groups.finished_so_far(self._peeked), key=lambda g: g.version)
            shown, room = [], self.config.train_batch_size  # (sorted is stable: queued first per version)
            for group in candidates:
                samples = group.samples[:room]
                shown.append(dataclasses.replace(group, samples=samples))
                self._peeked.update(s.trajectory.traj_id for s in samples)
                room -= len(samples)
                if room == 0:
                    break
            return shown

    def _commit(self, trainer_version: int) -> list[Group]:
        """The queued groups the take for `trainer_version` will hold, not committed before. The
        take is the `need` oldest groups by (version, arrival); a queued group at position i can
        only be pushed out of them by groups that arrive later and sort before it: groups in
        flight of an older version (new groups start at the newest version, a publish only moves
        unsent groups to a newer one). So it is committed if i + those < need. Legacy fill can
        still start an older group later; the take then stays oldest first and counts the
        commitment broken (`stats.commitments_broken`). Caller holds the lock."""
        if self._committed[0] != trainer_version:
            self._committed = (trainer_version, set())
        shown, need = self._committed[1], self.config.train_batch_size // self.config.group_size
        in_flight = sorted(group.version for group in self._groups.by_id.values())
        fresh = []
        for i, group in enumerate(self.queue.peek_oldest(need)):
            if i + bisect.bisect_left(in_flight, group.version) >= need:
                break  # and every later group: its position and the older groups in flight only grow
            if group.group_id not in shown:
                shown.add(group.group_id)
                fresh.append(group)
        self.stats.committed_groups += len(fresh)
        return fresh

    def take_batch(
        self,
        trainer_version: int,
        timeout: float | None = None,
        cancel: threading.Event | None = None,
        idle: Callable[[], bool] | None = None,
    ) -> list[Group] | None:
        """Blocks until `try_take_batch` succeeds; the wait is added to stats.trainer_wait_s (and
        the part of it C3 held a queued batch to stats.trainer_wait_c3_s). None once the
        coordinator is closed or `cancel` is set (nothing is taken then). Between tries it calls
        `idle()` (no lock held), which returns whether it did work (then it tries again at once)
        or not (then it waits a little); its time is work, not waiting."""
        start, working, held = time.monotonic(), 0.0, 0.0
        try:
            while True:
                tried = time.monotonic()
                batch, why = self._try_take(trainer_version)
                if batch is not None or self.closed or (cancel is not None and cancel.is_set()):
                    return batch
                if timeout is not None and tried - start > timeout:
                    raise TimeoutError(f"no batch for trainer version {trainer_version} after {timeout}s")
                worked, spent = False, 0.0
                if idle is not None:
                    t0 = time.monotonic()
                    try:
                        worked = idle()
                    finally:
                        spent = time.monotonic() - t0
                        working += spent
                if not worked:
                    with self._cond:
                        self._cond.wait(0.05)
                if why == "c3":
                    held += time.monotonic() - tried - spent
        finally:
            self.stats.trainer_wait_s += time.monotonic() - start - working
            self.stats.trainer_wait_c3_s += held


def _behaviour_source(traj: Trajectory, source: str) -> dict:
    """A consume event's record of where the row's behaviour log-probs come from: its own sampling
    log-probs (`source` = trainer.behaviour_logps = "sampler": the params that sampled it are the
    ones its slice loaded, whose digest the audit matches with the version's), its rollout slice
    scored them (with the digest of the params it scored with), or the trainer computes them. The
    trainer uses slice-scored log-probs exactly when they arrive, which is exactly under "rollout"
    (only then do slices score: dora_jax.runtime.roles.rollout.make_scorer)."""
    if source == "sampler":
        return {"behaviour": "sampler"}
    if traj.behaviour_logprobs is None:
        return {"behaviour": "trainer"}
    return {"behaviour": "rollout", "behaviour_digest": traj.behaviour_digest}
