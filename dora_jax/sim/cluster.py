"""The modelled cluster: rollout groups, their decode/prefill/transfer costs, and the trainer.

Decode is memory-bound: one decode step of a rollout group with `a` active slots costs
t(a) = t0 + t1 * a seconds and advances every active request by one token. `fit_decode` derives
(t0, t1) from a `bench engine` JSON ({"decode": [{"active_slots", "step_time_s"}, ...]}).

Placement says whether the trainer has its own accelerators (SPLIT: rollout and training overlap
in time) or time-shares all of them with rollout (COLOCATED: the groups stop decoding while the
trainer runs, as in a synchronous colocated RL loop).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Callable, Sequence

import numpy as np


class Placement(str, enum.Enum):
    SPLIT = "split"  # trainer accelerators are distinct from the rollout groups
    COLOCATED = "colocated"  # every accelerator rolls out, then every accelerator trains


@dataclasses.dataclass(frozen=True)
class DecodeModel:
    """Per-group decode step time t(a) = t0_s + t1_s * a for a >= 1 active slots.

    A fixed-shape engine, one step over every slot with a dense KV cache (today's RolloutEngine),
    costs the same at any `a`: t0 = its step time, t1 = 0 (what dora_jax/sim/projection.py uses).
    """

    t0_s: float
    t1_s: float

    def step_time(self, active: int) -> float:
        return self.t0_s + self.t1_s * active


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """Everything the simulator needs to know about the hardware, for one placement."""

    num_groups: int  # rollout (data-parallel) groups
    slots_per_group: int  # concurrent decode slots per group (KV-cache capacity)
    accelerators_per_group: int
    decode: DecodeModel
    prefill_s_per_token: float  # group time to prefill one token (new prompt or re-prefill)
    weight_load_s: float  # group stall to load another version's weights
    kv_bytes_per_token: float  # KV-cache bytes of one token (all layers)
    migrate_bytes_per_s: float  # point-to-point bandwidth of a KV-cache migration
    train_accelerators: int  # accelerators that run the trainer
    train_s_per_token: float  # accelerator-seconds per trained token (fwd + bwd + log-prob recompute)
    train_fixed_s: float  # per-step trainer time that does not shrink with more accelerators
    placement: Placement = Placement.SPLIT

    def __post_init__(self):
        if self.num_groups < 1 or self.slots_per_group < 1:
            raise ValueError(f"need >= 1 group and slot, got {self.num_groups}, {self.slots_per_group}")
        if self.train_accelerators < 1:
            raise ValueError(f"train_accelerators must be >= 1, got {self.train_accelerators}")

    @property
    def rollout_accelerators(self) -> int:
        return self.num_groups * self.accelerators_per_group

    @property
    def total_accelerators(self) -> int:
        if self.placement == Placement.COLOCATED:
            return self.rollout_accelerators
        return self.rollout_accelerators + self.train_accelerators

    def train_time(self, tokens: float) -> float:
        """Seconds for one optimizer step over `tokens` (prompt + response) tokens."""
        return self.train_fixed_s + self.train_s_per_token * tokens / self.train_accelerators

    def migrate_time(self, context_tokens: float) -> float:
        """Seconds to move one request's KV cache (its whole context) to another group."""
        return self.kv_bytes_per_token * context_tokens / self.migrate_bytes_per_s

    def full_rate_tokens_per_s(self) -> float:
        """Decode tokens per second of the whole rollout pool with every slot busy."""
        s = self.slots_per_group
        return self.num_groups * s / self.decode.step_time(s)


def fit_decode(points: Sequence[tuple[float, float]]) -> DecodeModel:
    """Least-squares line through (active_slots, step_time_s) points; t0 clipped at 0."""
    if len(points) < 2:
        raise ValueError("fit_decode needs at least two (active_slots, step_time_s) points")
    a = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    t1, t0 = np.polyfit(a, t, 1)
    return DecodeModel(t0_s=max(float(t0), 0.0), t1_s=max(float(t1), 0.0))


def decode_from_bench_json(path: str) -> DecodeModel:
    """Reads `bench engine` output: {"decode": [{"active_slots": a, "step_time_s": t}, ...]}."""
    with open(path) as f:
        data = json.load(f)
    return fit_decode([(row["active_slots"], row["step_time_s"]) for row in data["decode"]])


def make_cluster(
    *,
    accelerators: int,
    placement: Placement,
    train_accelerators: int,
    accelerators_per_group: int,
    slots_per_group: int,
    decode: DecodeModel,
    prefill_s_per_token: float,
    weight_load_s: float,
    kv_bytes_per_token: float,
    migrate_bytes_per_s: float,
    train_s_per_token: float,
    train_fixed_s: float,
) -> ClusterSpec:
    """Builds a ClusterSpec from an accelerator budget (split: the trainer takes its share)."""
    if placement == Placement.COLOCATED:
        rollout_acc, train_acc = accelerators, accelerators
    else:
        rollout_acc, train_acc = accelerators - train_accelerators, train_accelerators
    groups = rollout_acc // accelerators_per_group
    if groups < 1:
        raise ValueError(
            f"{accelerators} accelerators leave {rollout_acc} for rollout: fewer than one group "
            f"of {accelerators_per_group}"
        )
    return ClusterSpec(
        num_groups=groups,
        slots_per_group=slots_per_group,
        accelerators_per_group=accelerators_per_group,
        decode=decode,
        prefill_s_per_token=prefill_s_per_token,
        weight_load_s=weight_load_s,
        kv_bytes_per_token=kv_bytes_per_token,
        migrate_bytes_per_s=migrate_bytes_per_s,
        train_accelerators=train_acc,
        train_s_per_token=train_s_per_token,
        train_fixed_s=train_fixed_s,
        placement=placement,
    )


def balanced_train_accelerators(
    accelerators: int,
    granularity: int,
    rollout_work_s: Callable[[int], float],
    train_work_s: Callable[[int], float],
) -> int:
    """Trainer share (a multiple of `granularity`) minimising max(rollout, train) work per step.

    `rollout_work_s(n)` and `train_work_s(n)` give a step's busy-time on n accelerators.
    """
    best, best_time = granularity, math.inf
    for n_train in range(granularity, accelerators, granularity):
        t = max(rollout_work_s(accelerators - n_train), train_work_s(n_train))
        if t < best_time:
            best, best_time = n_train, t
    return best
