"""DORA's multi-version streaming policy and its load-balancing orchestrator.

- Every group serves one version; a prompt is tagged with the newest version when dispatched and
  all of its tokens come from that version (C1). Requests are never dropped (C2).
- RBS > TBS samples are kept in flight; new prompts go to the newest version only.
- The trainer takes TBS samples (whole prompt groups) as soon as they are complete, oldest
  versions first, and may go from version t to t+1 only if afterwards no unconsumed sample has a
  version below t+1-K (C3), nor would any be left unconsumable in time by later batches
  (TransferQueue.take); otherwise it waits, and the wait is measured.
- Rebalance (after every publish, when a group runs dry, and every `period_s`):
  1. supplement: top the in-flight count up to RBS with new prompts on the newest version;
  2. repartition: an old version w keeps DP_w = max(ceil(R_w / S), round(N R_w / sum R)) groups,
     R_w its active + pending samples; the rest of its groups move to the newest version;
  3. migrate: requests on a group that moves go, with their KV cache (transfer time, no
     re-prefill), to the kept groups of the same version, emptiest first;
  4. fill: optionally, residual free slots of a kept old-version group get new prompts of that
     version, only if it still has >= `fill_slack` steps before the window closes on it and the
     window can still absorb them (TransferQueue.window_room).
"""

from __future__ import annotations

import math

from dora_jax.sim.engine import Group
from dora_jax.sim.kernel import Kind, Sim


class DoraPolicy:
    def __init__(self, rbs: int, k_max: int, period_s: float, fill_slack: int = 0):
        if k_max < 1:
            raise ValueError(f"dora needs k_max >= 1, got {k_max}")
        if fill_slack == 1:
            # With one step of slack the trainer can already be waiting on that version, and
            # filling it again would keep it alive forever (a livelock).
            raise ValueError("fill_slack must be 0 (off) or >= 2")
        self.rbs, self.k_max, self.period_s, self.fill_slack = rbs, k_max, period_s, fill_slack
        self.window_waits = 0  # times a ready batch was refused by the version window

    # ---- callbacks --------------------------------------------------------------------------------
    def start(self, sim: Sim) -> None:
        self._supplement(sim)
        sim.refill_all()
        sim.queue.push(self.period_s, Kind.TIMER)

    def on_finished(self, sim: Sim, group: Group, trajs: list[int]) -> None:
        self._supplement(sim)
        sim.pool.fill(group, sim.now, schedule=False)
        if not group.active:
            self.rebalance(sim)
        self._try_train(sim)

    def on_published(self, sim: Sim) -> None:
        sim.retag_unstarted()
        self.rebalance(sim)
        self._try_train(sim)

    def on_timer(self, sim: Sim) -> None:
        self.rebalance(sim)
        self._try_train(sim)
        sim.queue.push(sim.now + self.period_s, Kind.TIMER)

    # ---- trainer side -------------------------------------------------------------------------------
    def _try_train(self, sim: Sim) -> None:
        if sim.trainer_busy or sim.transfer.ready_samples < sim.workload.batch_samples:
            return
        batch = sim.transfer.take(sim.workload.batch_samples, window=(self.k_max, sim.version))
        if batch is None:
            self.window_waits += 1
            return
        sim.train(batch)

    # ---- orchestrator -------------------------------------------------------------------------------
    def _supplement(self, sim: Sim) -> None:
        sim.supplement(self.rbs, self.k_max)

    def rebalance(self, sim: Sim) -> None:
        pool, now, newest = sim.pool, sim.now, sim.version
        self._supplement(sim)
        by_version: dict[int, list[Group]] = {}
        for g in pool.groups:
            by_version.setdefault(g.version, []).append(g)
        load = {v: sum(len(g.active) for g in gs) + len(pool.pending.get(v, ()))
                for v, gs in by_version.items()}
        load.setdefault(newest, len(pool.pending.get(newest, ())))
        total = max(1, sum(load.values()))
        n, s = len(pool.groups), pool.slots
        for v in sorted(by_version):
            if v == newest:
                continue
            groups = by_version[v]
            keep = 0 if load[v] == 0 else max(math.ceil(load[v] / s), round(n * load[v] / total))
            if keep < len(groups):
                groups.sort(key=lambda g: len(g.active), reverse=True)
                kept, released = groups[:keep], groups[keep:]
                self._migrate_off(sim, released, kept)
                for g in released:
                    pool.switch(g, newest, now)
                by_version[v] = kept
            self._fill_residual(sim, v, by_version[v])
        for g in pool.groups:
            pool.fill(g, now)

    def _migrate_off(self, sim: Sim, released: list[Group], kept: list[Group]) -> None:
        """Moves every request on `released` to the emptiest kept group (same version)."""
        pool = sim.pool
        for src in released:
            for traj in list(src.active):
                dst = min(kept, key=lambda g: len(g.active))
                assert len(dst.active) < pool.slots, "repartition kept too few groups"
                pool.migrate(traj, src, dst, sim.now)

    def _fill_residual(self, sim: Sim, version: int, kept: list[Group]) -> None:
        if not self.fill_slack or not kept:
            return
        if version + self.k_max - sim.version < self.fill_slack:
            return
        g = sim.workload.samples_per_prompt
        free = sum(sim.pool.slots - len(k.active) for k in kept)
        free -= len(sim.pool.pending.get(version, ()))
        free = min(free, sim.window_room(version, self.k_max))
        if free >= g:
            sim.dispatch(free // g, version)
