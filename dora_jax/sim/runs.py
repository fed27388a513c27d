"""A scenario's simulated runs as independent tasks, run here or spread over worker processes.

Every run is deterministic and shares nothing with another (its own coordinator, slices, response
lengths and ledger), so spreading them over processes changes how long the command takes, never
a result. The coordinator's measured cost is CPU time of the thread that runs it, so a run beside
another on the next core reads the same cost as a run alone.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor

from dora_jax.core.modes import Mode
from dora_jax.sim.scenario import Scenario
from dora_jax.sim.simulate import ModeResult, simulate
from dora_jax.sim.workload import WorkloadSpec


@dataclasses.dataclass(frozen=True)
class RunTask:
    """One mode on one cluster size: what `simulate` needs beyond the scenario."""

    mode: Mode
    accelerators: int
    workload: WorkloadSpec
    steps: int
    warmup: int
    ledger_path: str | None = None
    kv_migration: bool = True  # False: the re-prefill ablation

    @property
    def weight(self) -> float:
        """A guess at its cost (events grow with samples, per-event work with slices): the
        longest start first, so the last to finish is a short one."""
        return self.steps * self.workload.batch_samples * (1.0 + self.accelerators / 1024)


def default_jobs() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def simulate_task(sc: Scenario, task: RunTask) -> ModeResult:
    mode, workload = task.mode, task.workload
    return simulate(
        sc.placements.cluster(sc.costs, mode, task.accelerators, workload),
        workload,
        mode,
        sc.options.k_max,
        steps=task.steps,
        warmup=task.warmup,
        rbs=sc.options.rbs(workload),
        chunk_tokens=sc.options.chunk_tokens,
        rebalance_period_s=sc.options.rebalance_period_s,
        coordinator_tick_s=sc.options.coordinator_tick_s,
        legacy_fill=sc.options.legacy_fill and mode == Mode.DORA,
        kv_migration=task.kv_migration,
        ledger_path=task.ledger_path,
    )


def run_tasks(sc: Scenario, tasks: Sequence[RunTask], jobs: int = 1) -> list[ModeResult]:
    """Each task's result, in the tasks' order; with `jobs` > 1 on that many worker processes."""
    if jobs < 1:
        raise ValueError(f"jobs={jobs}; expected >= 1")
    if jobs == 1 or len(tasks) < 2:
        return [simulate_task(sc, task) for task in tasks]
    order = sorted(range(len(tasks)), key=lambda i: -tasks[i].weight)
    # Workers forked from a fresh server process, not from this one: a caller that has started
    # threads (jax's, in a notebook or a test process) cannot hand a held lock to a forked child.
    context = multiprocessing.get_context("forkserver")
    with ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), mp_context=context) as pool:
        futures = {i: pool.submit(simulate_task, sc, tasks[i]) for i in order}
        return [futures[i].result() for i in range(len(tasks))]
