"""From a `configs/sim_*.py` ConfigDict to frozen records: cost model, placements, run options.

The config is read and validated once here; nothing downstream sees the ConfigDict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from dora_jax.core.modes import Mode
from dora_jax.sim.cluster import (
    ClusterSpec,
    DecodeModel,
    Placement,
    balanced_train_accelerators,
    decode_from_bench_json,
    make_cluster,
)
from dora_jax.sim.workload import WorkloadSpec, mean_response

_BATCH_SCALING = ("fixed", "proportional")


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Per-group and per-accelerator costs, independent of how many accelerators there are."""

    accelerators_per_group: int
    slots_per_group: int
    decode: DecodeModel
    prefill_s_per_token: float
    weight_load_s: float
    kv_bytes_per_token: float
    migrate_bytes_per_s: float
    train_s_per_token: float
    train_fixed_s: float

    def cluster(self, accelerators: int, placement: Placement, train_accelerators: int) -> ClusterSpec:
        return make_cluster(
            accelerators=accelerators,
            placement=placement,
            train_accelerators=train_accelerators,
            **vars(self),
        )

    def rollout_work_s(self, rollout_accelerators: int, workload: WorkloadSpec) -> float:
        """One step's rollout time with every slot busy (decode + prompt prefill), no waiting."""
        groups = rollout_accelerators // self.accelerators_per_group
        if groups < 1:
            return float("inf")
        s = self.slots_per_group
        tokens = workload.batch_samples * mean_response(workload)
        decode = tokens * self.decode.step_time(s) / s
        prefill = workload.prompts_per_step * workload.prompt_tokens * self.prefill_s_per_token
        return (decode + prefill) / groups

    def train_work_s(self, train_accelerators: int, workload: WorkloadSpec) -> float:
        tokens = workload.batch_samples * (mean_response(workload) + workload.prompt_tokens)
        return self.train_fixed_s + self.train_s_per_token * tokens / train_accelerators


@dataclasses.dataclass(frozen=True)
class RunOptions:
    modes: tuple[Mode, ...]
    k_max: int
    steps: int
    warmup: int
    rbs_factor: float  # RBS = rbs_factor x TBS, in whole prompts
    chunk_tokens: float
    rebalance_period_s: float  # the coordinator's periodic rebalance trigger, in simulated seconds
    coordinator_tick_s: float  # the coordinator applies posted events at most this often (0: at once)
    legacy_fill: bool = False  # dora: the coordinator's legacy fill (coordinator/legacy_fill.py)

    def rbs(self, workload: WorkloadSpec) -> int:
        g = workload.samples_per_prompt
        return max(workload.batch_samples, int(self.rbs_factor * workload.batch_samples) // g * g)


@dataclasses.dataclass(frozen=True)
class Placements:
    by_mode: Mapping[Mode, Placement]
    node_size: int  # trainer/rollout split granularity (accelerators per host)
    train_accelerators: int  # > 0: this many trainer accelerators at every size
    train_fraction: float  # > 0 (and no fixed count): this share, rounded to whole nodes

    def split(self, costs: CostModel, accelerators: int, workload: WorkloadSpec) -> int:
        """Trainer accelerators of a split placement; the rest roll out."""
        if self.train_accelerators:
            return self.train_accelerators
        if self.train_fraction:
            nodes = round(self.train_fraction * accelerators / self.node_size)
            return min(max(nodes, 1), accelerators // self.node_size - 1) * self.node_size
        return balanced_train_accelerators(
            accelerators,
            self.node_size,
            lambda n: costs.rollout_work_s(n, workload),
            lambda n: costs.train_work_s(n, workload),
        )

    def cluster(self, costs: CostModel, mode: Mode, accelerators: int, workload: WorkloadSpec) -> ClusterSpec:
        placement = self.by_mode[mode]
        colocated = placement == Placement.COLOCATED
        train = accelerators if colocated else self.split(costs, accelerators, workload)
        return costs.cluster(accelerators, placement, train)


@dataclasses.dataclass(frozen=True)
class Scenario:
    workload: WorkloadSpec
    costs: CostModel
    options: RunOptions
    placements: Placements
    settings: tuple[int, ...]  # accelerator counts compared with the paper
    sweep_accelerators: tuple[int, ...]
    sweep_steps: int
    sweep_warmup: int
    sweep_batch_scaling: str
    paper: Mapping[str, Any]


def _enum(kind, value, field):
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{field}={value!r}; allowed: {[k.value for k in kind]}") from None


def from_config(config) -> Scenario:
    """Validates the config and builds the scenario records."""
    e, tr, r, p, sw = config.engine, config.trainer, config.run, config.placement, config.sweep
    decode = (
        decode_from_bench_json(e.bench_json) if e.bench_json else DecodeModel(t0_s=e.decode_t0_s, t1_s=e.decode_t1_s)
    )
    costs = CostModel(
        accelerators_per_group=e.accelerators_per_group,
        slots_per_group=e.slots_per_group,
        decode=decode,
        prefill_s_per_token=e.prefill_s_per_token,
        weight_load_s=e.weight_load_s,
        kv_bytes_per_token=e.kv_bytes_per_token,
        migrate_bytes_per_s=e.migrate_bytes_per_s,
        train_s_per_token=tr.train_s_per_token,
        train_fixed_s=tr.train_fixed_s,
    )
    modes = tuple(_enum(Mode, m, "run.modes") for m in r.modes)
    options = RunOptions(
        modes=modes,
        k_max=r.k_max,
        steps=r.steps,
        warmup=r.warmup,
        rbs_factor=r.rbs_factor,
        chunk_tokens=r.chunk_tokens,
        rebalance_period_s=r.rebalance_period_s,
        coordinator_tick_s=r.coordinator_tick_s,
        legacy_fill=r.legacy_fill,
    )
    by_mode = {m: _enum(Placement, p[m.value], f"placement.{m.value}") for m in Mode}
    if by_mode[Mode.ONE_STEP_OFF] == Placement.COLOCATED or by_mode[Mode.DORA] == Placement.COLOCATED:
        raise ValueError("placement.one_step_off and placement.dora need 'split': they overlap roles")
    if sw.batch_scaling not in _BATCH_SCALING:
        raise ValueError(f"sweep.batch_scaling={sw.batch_scaling!r}; allowed: {_BATCH_SCALING}")
    if not 0.0 <= p.train_fraction < 1.0:
        raise ValueError(f"placement.train_fraction={p.train_fraction}; allowed: [0, 1)")
    if r.coordinator_tick_s < 0:
        raise ValueError(f"run.coordinator_tick_s={r.coordinator_tick_s}; expected >= 0")
    if r.k_max < 1 or not 0 <= r.warmup < r.steps or not 0 <= sw.warmup < sw.steps:
        raise ValueError("need run.k_max >= 1, 0 <= run.warmup < run.steps, 0 <= sweep.warmup < sweep.steps")
    return Scenario(
        workload=WorkloadSpec(**config.workload.to_dict()),
        costs=costs,
        options=options,
        placements=Placements(
            by_mode=by_mode,
            node_size=p.node_size,
            train_accelerators=p.train_accelerators,
            train_fraction=p.train_fraction,
        ),
        settings=tuple(config.settings),
        sweep_accelerators=tuple(sw.accelerators),
        sweep_steps=sw.steps,
        sweep_warmup=sw.warmup,
        sweep_batch_scaling=sw.batch_scaling,
        paper=config.paper.to_dict(),
    )
