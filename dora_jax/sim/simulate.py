"""`simulate(cluster, workload, mode, k_max)`: one mode on one modelled cluster -> ModeResult.

Metrics are taken over a measured window: from the publish of step `warmup` to the publish of the
last step, so pipeline fill-up at the start does not count.
- step_time_s: window / measured steps; tokens_per_s: response tokens trained in the window / window.
- rollout_only_share: share of the window in which some rollout request was active and the
  trainer was idle.
- bubble_ratio: idle slot-time / total slot-time of the rollout groups (time-weighted; a group
  counts as S slots whenever it is not lent to a colocated trainer).
- trainer_wait_s: trainer idle seconds per measured step.
- max_staleness and audit_ok come from the auditor reading the run's event log.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

from dora_jax.sim.cluster import ClusterSpec, Placement
from dora_jax.sim.dora import DoraPolicy
from dora_jax.sim.kernel import Policy, Sim
from dora_jax.sim.ledger import AuditReport, audit
from dora_jax.sim.policies import OneStepOffPolicy, PartialRolloutPolicy, SyncPolicy
from dora_jax.sim.workload import LengthSource, WorkloadSpec


class Mode(str, enum.Enum):
    SYNC = "sync"
    ONE_STEP_OFF = "one_step_off"
    PARTIAL_ROLLOUT = "partial_rollout"
    DORA = "dora"


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
    audit_ok: bool
    audit: AuditReport
    staleness_bound: int
    migrations: int
    migration_share: float  # KV-transfer seconds / rollout group-seconds, in the window
    prefill_share: float  # prefill (incl. re-prefill) group-seconds / rollout group-seconds
    weight_loads: int
    prefill_tokens: float  # whole run
    window_waits: int  # DORA: times a complete batch was held back by the version window

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["mode"] = self.mode.value
        d["audit"] = self.audit.as_dict()
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}


def make_policy(mode: Mode, workload: WorkloadSpec, k_max: int, rbs: int, period_s: float,
                fill_slack: int) -> Policy:
    """The one factory from a mode to its policy."""
    match mode:
        case Mode.SYNC:
            return SyncPolicy()
        case Mode.ONE_STEP_OFF:
            return OneStepOffPolicy()
        case Mode.PARTIAL_ROLLOUT:
            return PartialRolloutPolicy(rbs, k_max)
        case Mode.DORA:
            return DoraPolicy(rbs, k_max, period_s, fill_slack)
    raise ValueError(f"unknown mode {mode!r}; allowed: {[m.value for m in Mode]}")


def staleness_bound(mode: Mode, k_max: int) -> int:
    return {Mode.SYNC: 0, Mode.ONE_STEP_OFF: 1}.get(mode, k_max)


def simulate(
    cluster: ClusterSpec,
    workload: WorkloadSpec,
    mode: Mode | str,
    k_max: int = 3,
    *,
    steps: int = 8,
    warmup: int = 2,
    rbs: Optional[int] = None,
    chunk_tokens: float = 8.0,
    rebalance_period_s: float = 30.0,
    fill_slack: int = 0,
    kv_migration: bool = True,
    lengths: Optional[LengthSource] = None,
    ledger_path: Optional[str] = None,
) -> ModeResult:
    """Simulates `steps` training steps of `mode`; `rbs` defaults to 1.5 x TBS (whole prompts).

    `kv_migration=False` is an ablation: DORA's migrated requests re-prefill instead of moving
    their KV cache. `lengths` replaces the workload's log-normal response lengths.
    """
    mode = Mode(mode)
    if mode in (Mode.ONE_STEP_OFF, Mode.DORA) and cluster.placement != Placement.SPLIT:
        raise ValueError(f"{mode.value} overlaps rollout and training: it needs a split placement")
    if not 0 <= warmup < steps:
        raise ValueError(f"need 0 <= warmup < steps, got warmup={warmup}, steps={steps}")
    tbs, g = workload.batch_samples, workload.samples_per_prompt
    rbs = rbs if rbs is not None else (3 * tbs // 2) // g * g
    if rbs < tbs:
        raise ValueError(f"rbs ({rbs}) must be >= the train batch ({tbs} samples)")
    policy = make_policy(mode, workload, k_max, rbs, rebalance_period_s, fill_slack)
    sim = Sim(cluster, workload, policy, steps, chunk_tokens, kv_migration, lengths)
    sim.run()
    if ledger_path:
        sim.log.write_jsonl(ledger_path)
    bound = staleness_bound(mode, k_max)
    report = audit(sim.log, bound, g)
    waits = policy.window_waits if isinstance(policy, DoraPolicy) else 0
    return _summarise(sim, mode, warmup, report, bound, waits)


def _summarise(sim: Sim, mode: Mode, warmup: int, report: AuditReport, bound: int,
               window_waits: int) -> ModeResult:
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
    group_seconds = sim.cluster.num_groups * max(window - lent, 1e-12)
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
        migrations=sim.pool.migrations,
        migration_share=(last.migration_s - first.migration_s) / group_seconds,
        prefill_share=(last.prefill_tokens - first.prefill_tokens) * sim.cluster.prefill_s_per_token
        / group_seconds,
        weight_loads=last.weight_loads - first.weight_loads,
        prefill_tokens=sim.pool.prefill_tokens,
        window_waits=window_waits,
    )
