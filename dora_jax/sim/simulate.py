"""`simulate(cluster, workload, mode, k_max)`: one mode on one modelled cluster -> ModeResult.

The mode is the shipped policy (`dora_jax.core.modes`, run by the real coordinator, see kernel.py);
the simulator adds time and cost. Metrics are taken over a measured window: from the publish of
step `warmup` to the publish of the last step, so pipeline fill-up at the start does not count.
- step_time_s: window / measured steps; tokens_per_s: response tokens trained in the window / window.
- rollout_only_share: share of the window in which some rollout request was active and the
  trainer was idle.
- bubble_ratio: idle slot-time / total slot-time of the rollout slices (time-weighted; a slice
  counts as S slots whenever it is not lent to a colocated trainer).
- trainer_wait_s: trainer idle seconds per measured step.
- max_staleness and audit_ok come from the project's auditor (`dora_jax.coordinator.audit`)
  reading the run's ledger: what `python -m dora_jax.audit` says of the same file.
"""

from __future__ import annotations

import dataclasses

from dora_jax.coordinator.audit import AuditReport, audit
from dora_jax.coordinator.coordinator import CoordinatorConfig
from dora_jax.core.modes import Mode
from dora_jax.sim.cluster import ClusterSpec, Placement
from dora_jax.sim.kernel import Sim
from dora_jax.sim.workload import LengthSource, WorkloadSpec

_OVERLAPPING = (Mode.ONE_STEP_OFF, Mode.DORA)  # train while rolling out: need their own trainer


@dataclasses.dataclass(frozen=True)
class ModeResult:
    mode: Mode
    wall_s: float  # simulated time until the last publish
    steps: int  # measured steps (after warm-up)
    train_tokens: int  # response tokens trained in the measured window
    tokens_per_s: float
    step_time_s: float
    rollout_only_share: float
    rollout_only_s_per_step: float
    bubble_ratio: float
    trainer_wait_s: float  # per measured step
    max_staleness: int
    audit_ok: bool  # no violation of what the mode promises (partial_rollout: C1 is not promised)
    audit: AuditReport
    staleness_bound: int
    migrations: int  # requests moved with their KV cache (whole run)
    migration_share: float  # KV-transfer seconds / rollout slice-seconds, in the window
    prefill_share: float  # prefill (incl. re-prefill) slice-seconds / rollout slice-seconds
    weight_loads: int  # in the window
    prefill_tokens: float  # whole run
    window_waits: int  # trainer attempts refused by the version window with a full batch ready
    interrupts: int  # partial rollout: requests re-prefilled on a new version (whole run)
    rebalances: int  # orchestrator cycles (whole run)
    max_versions_in_flight: int
    legacy_groups: int  # groups started at an older version by legacy fill (whole run)
    # The coordinator's own host cost (CPU seconds of its thread, simulated ports excluded),
    # in the window: per step, and as a share of the simulated step time.
    coordinator_s_per_step: float
    orchestration_overhead: float
    rebalance_ms_p99: float  # one switching pass (placement, orchestrator, migrations), CPU ms, whole run
    rebalance_ms_max: float

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["mode"] = self.mode.value
        d["audit"] = audit_summary(self.audit)
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}


def audit_summary(report: AuditReport) -> dict:
    """The auditor's counts for results.json (its violation lists are long at paper scale)."""
    return dict(
        ok=report.ok,
        violations=report.violations(),
        mode=report.mode,
        k_max=report.k_max,
        dispatched=report.dispatched,
        finished=report.finished,
        consumed=report.consumed,
        live_at_end=report.in_flight_at_end + report.unconsumed_finished_at_end,
        in_flight_at_end=report.in_flight_at_end,
        unconsumed_finished_at_end=report.unconsumed_finished_at_end,
        c1_violations=len(report.c1_violations),
        c2_violations=len(report.c2_violations),
        c3_violations=len(report.c3_violations),
        exactly_once_violations=len(report.exactly_once_violations),
        max_staleness=report.max_staleness,
        staleness_hist={int(k): v for k, v in sorted(report.staleness_histogram.items())},
        migrations_kv=report.migrations_kv,
        migrations_no_kv=report.migrations_no_kv,
        max_versions_in_flight=report.max_versions_in_flight,
        publishes=report.publishes,
    )


def coordinator_config(
    workload: WorkloadSpec,
    mode: Mode | str,
    k_max: int,
    rbs: int | None = None,
    rebalance_period_s: float = 30.0,
    legacy_fill: bool = False,
) -> CoordinatorConfig:
    """The coordinator settings of a simulated run; `rbs` defaults to 1.5 x TBS (whole prompts)."""
    tbs, g = workload.batch_samples, workload.samples_per_prompt
    rbs = rbs if rbs is not None else max(tbs, (3 * tbs // 2) // g * g)
    return CoordinatorConfig(
        mode=Mode(mode).value,
        k_max=k_max,
        rollout_batch_size=rbs,
        train_batch_size=tbs,
        group_size=g,
        max_new_tokens=workload.max_response,
        rebalance_period_s=rebalance_period_s,
        legacy_fill=legacy_fill,
        # The simulated ports answer at once, in virtual time: a thread per call would only cost CPU
        # and make the event order depend on the host's scheduler.
        apply_results_during_calls=False,
    )


def simulate(
    cluster: ClusterSpec,
    workload: WorkloadSpec,
    mode: Mode | str,
    k_max: int = 3,
    *,
    steps: int = 8,
    warmup: int = 2,
    rbs: int | None = None,
    chunk_tokens: float = 8.0,
    rebalance_period_s: float = 30.0,
    coordinator_tick_s: float = 0.0,
    kv_migration: bool = True,
    lengths: LengthSource | None = None,
    ledger_path: str | None = None,
    legacy_fill: bool = False,
) -> ModeResult:
    """Simulates `steps` training steps of `mode`.

    `kv_migration=False` is an ablation: a request the orchestrator migrates re-prefills instead
    of moving its KV cache. `lengths` replaces the workload's log-normal response lengths.
    `coordinator_tick_s` > 0 lets the coordinator apply posted events at most that often (its
    loop's latency) instead of after every event. `legacy_fill` turns on the coordinator's legacy
    fill (dora only).
    """
    mode = Mode(mode)
    if mode in _OVERLAPPING and cluster.placement != Placement.SPLIT:
        raise ValueError(f"{mode.value} overlaps rollout and training: it needs a split placement")
    if not 0 <= warmup < steps:
        raise ValueError(f"need 0 <= warmup < steps, got warmup={warmup}, steps={steps}")
    config = coordinator_config(workload, mode, k_max, rbs, rebalance_period_s, legacy_fill)
    sim = Sim(
        cluster,
        workload,
        config,
        steps,
        chunk_tokens,
        coordinator_tick_s=coordinator_tick_s,
        kv_migration=kv_migration,
        lengths=lengths,
        ledger_path=ledger_path,
    )
    sim.run()
    return _summarise(sim, mode, warmup, audit(sim.ledger.memory), config.window)


def _summarise(sim: Sim, mode: Mode, warmup: int, report: AuditReport, bound: int) -> ModeResult:
    first, last = sim.snapshots[warmup], sim.snapshots[-1]
    window = last.t - first.t
    measured = last.step - first.step
    slots = sim.cluster.num_groups * sim.cluster.slots_per_group
    lent = last.colocated_train_s - first.colocated_train_s
    capacity = slots * max(window - lent, 1e-12)
    busy = last.busy_slot_s - first.busy_slot_s
    rollout_only = last.rollout_only_s - first.rollout_only_s
    train_busy = last.train_busy_s - first.train_busy_s
    tokens = last.tokens - first.tokens
    slice_seconds = sim.cluster.num_groups * max(window - lent, 1e-12)
    stats = sim.coordinator.stats
    return ModeResult(
        mode=mode,
        wall_s=last.t,
        steps=measured,
        train_tokens=tokens,
        tokens_per_s=tokens / window,
        step_time_s=window / measured,
        rollout_only_share=rollout_only / window,
        rollout_only_s_per_step=rollout_only / measured,
        bubble_ratio=max(0.0, 1.0 - busy / capacity),
        trainer_wait_s=(window - train_busy) / measured,
        max_staleness=report.max_staleness,
        audit_ok=report.ok,
        audit=report,
        staleness_bound=bound,
        migrations=stats.migrations_kv,
        migration_share=(last.migration_s - first.migration_s) / slice_seconds,
        prefill_share=(last.prefill_tokens - first.prefill_tokens) * sim.cluster.prefill_s_per_token / slice_seconds,
        weight_loads=last.weight_loads - first.weight_loads,
        prefill_tokens=last.prefill_tokens,
        window_waits=sim.window_waits,
        interrupts=stats.interrupts,
        rebalances=stats.rebalances,
        max_versions_in_flight=stats.max_versions_in_flight,
        legacy_groups=stats.legacy_groups,
        coordinator_s_per_step=(last.coordinator_s - first.coordinator_s) / measured,
        orchestration_overhead=(last.coordinator_s - first.coordinator_s) / window,
        rebalance_ms_p99=_percentile_ms(sim.coordinator.switching_s, 0.99),
        rebalance_ms_max=_percentile_ms(sim.coordinator.switching_s, 1.0),
    )


def _percentile_ms(seconds, q: float) -> float:
    values = sorted(seconds)
    return 1e3 * values[min(len(values) - 1, int(q * len(values)))] if values else 0.0
