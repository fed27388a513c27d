"""The three baseline modes as kernel policies: sync, one_step_off, partial_rollout.

DORA's policy (multi-version streaming with the orchestrator) lives in `dora.py`.
"""

from __future__ import annotations

from dora_jax.sim.cluster import Placement
from dora_jax.sim.engine import Group
from dora_jax.sim.kernel import Sim


class SyncPolicy:
    """Dispatch B x G on the current version, wait for all, train, publish, repeat (staleness 0)."""

    def start(self, sim: Sim) -> None:
        sim.dispatch(sim.workload.prompts_per_step, sim.version)
        sim.refill_all()

    def on_finished(self, sim: Sim, group: Group, trajs: list[int]) -> None:
        sim.pool.fill(group, sim.now, schedule=False)
        if not sim.pool.unfinished() and not sim.trainer_busy:
            sim.train(sim.transfer.take(sim.workload.batch_samples))

    def on_published(self, sim: Sim) -> None:
        for g in sim.pool.groups:
            sim.pool.switch(g, sim.version, sim.now)
        self.start(sim)

    def on_timer(self, sim: Sim) -> None:
        pass


class OneStepOffPolicy:
    """Rollout phase k (version max(0, k-1)) overlaps training step k-1 (staleness <= 1).

    Phase k+1 starts once phase k is complete and version k is published; training step k starts
    once phase k is complete and the trainer is free. Each phase is a batch barrier: its tail
    still leaves slots idle.
    """

    def __init__(self):
        self.phases_done = 0
        self.phase_running = False
        self.trained = 0

    def start(self, sim: Sim) -> None:
        self._start_phase(sim)

    def _start_phase(self, sim: Sim) -> None:
        version = max(0, self.phases_done - 1)
        for g in sim.pool.groups:
            sim.pool.switch(g, version, sim.now)
        sim.dispatch(sim.workload.prompts_per_step, version)
        self.phase_running = True
        sim.refill_all()

    def _advance(self, sim: Sim) -> None:
        if not sim.trainer_busy and self.trained < self.phases_done:
            sim.train(sim.transfer.take(sim.workload.batch_samples))
            self.trained += 1
        if not self.phase_running and sim.version >= self.phases_done - 1:
            self._start_phase(sim)

    def on_finished(self, sim: Sim, group: Group, trajs: list[int]) -> None:
        sim.pool.fill(group, sim.now, schedule=False)
        if self.phase_running and not sim.pool.unfinished():
            self.phase_running = False
            self.phases_done += 1
            self._advance(sim)

    def on_published(self, sim: Sim) -> None:
        self._advance(sim)

    def on_timer(self, sim: Sim) -> None:
        pass


class PartialRolloutPolicy:
    """Keeps `rbs` samples in flight on the newest version; the trainer takes TBS finished samples.

    At every publish all in-flight requests are interrupted, every group loads the new weights and
    the requests continue on the new version after re-prefilling prompt + generated tokens. Their
    tokens then come from several versions: this mode breaks C1 by design. Colocated, rollout
    stops (requests interrupted, KV memory released) while every GPU trains, as in partial
    rollout on a synchronous colocated system.
    """

    def __init__(self, rbs: int, k_max: int):
        self.rbs, self.k_max = rbs, k_max

    def _supplement(self, sim: Sim) -> None:
        sim.supplement(self.rbs, self.k_max)

    def _try_train(self, sim: Sim) -> None:
        if sim.trainer_busy:
            return
        batch = sim.transfer.take(sim.workload.batch_samples)
        if batch is None:
            return
        if sim.cluster.placement == Placement.COLOCATED:
            self._interrupt_all(sim)  # the trainer needs the GPUs (and their KV memory) now
        sim.train(batch)

    def _interrupt_all(self, sim: Sim) -> None:
        pool, interrupted = sim.pool, []
        for g in pool.groups:
            for traj in list(g.active):
                pool.interrupt(g, traj, sim.now)
                interrupted.append(traj)
            pool.schedule(g)
        pool.pending[sim.version].extendleft(reversed(interrupted))

    def start(self, sim: Sim) -> None:
        self._supplement(sim)
        sim.refill_all()

    def on_finished(self, sim: Sim, group: Group, trajs: list[int]) -> None:
        self._supplement(sim)
        sim.pool.fill(group, sim.now, schedule=False)
        self._try_train(sim)

    def on_published(self, sim: Sim) -> None:
        pool = sim.pool
        self._interrupt_all(sim)  # onto the newest pending queue, ahead of unstarted prompts
        pool.retag_pending(sim.version, sim.now)
        for g in pool.groups:
            pool.switch(g, sim.version, sim.now)
        self._supplement(sim)
        sim.refill_all()
        self._try_train(sim)

    def on_timer(self, sim: Sim) -> None:
        pass
