"""Fits the cost model's free constants to the paper's synchronous baseline.

Only sync's numbers are used as targets, so every asynchronous result stays a prediction:
- trainer: sync's train seconds per step at two cluster sizes, T(n) = (1 - share_n) * step_n, give
  the two unknowns of T(n) = fixed + per_token * tokens / n (a 2-point fit in 1/n);
- decode: t(a) = t0 + t1 * a. t1 (KV-cache bytes read per extra slot / group HBM bandwidth) comes
  from the hardware, because sync's timings barely constrain it: a sync step is dominated by its
  tail, which decodes at small a. t0 is bisected so that the simulated sync rollout seconds per
  step hit the paper's at the first size; the second size is then a prediction (a validation).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dora_jax.core.modes import Mode
from dora_jax.sim.cluster import DecodeModel, Placement
from dora_jax.sim.scenario import CostModel
from dora_jax.sim.simulate import simulate
from dora_jax.sim.workload import WorkloadSpec, mean_response


@dataclasses.dataclass(frozen=True)
class SyncTarget:
    accelerators: int
    step_s: float
    rollout_share: float

    @property
    def rollout_s(self) -> float:
        return self.step_s * self.rollout_share

    @property
    def train_s(self) -> float:
        return self.step_s * (1.0 - self.rollout_share)


def solve_train(a: SyncTarget, b: SyncTarget, workload: WorkloadSpec) -> tuple[float, float]:
    """(train_fixed_s, train_s_per_token) through sync's train time at two sizes."""
    tokens = workload.batch_samples * (mean_response(workload) + workload.prompt_tokens)
    x_a, x_b = 1.0 / a.accelerators, 1.0 / b.accelerators
    slope = (a.train_s - b.train_s) / (x_a - x_b)  # seconds per (1 / accelerators)
    fixed = a.train_s - slope * x_a
    return max(fixed, 0.0), slope / tokens


def sync_rollout_s(costs: CostModel, accelerators: int, workload: WorkloadSpec, steps: int = 3) -> float:
    cluster = costs.cluster(accelerators, Placement.COLOCATED, accelerators)
    result = simulate(cluster, workload, Mode.SYNC, steps=steps, warmup=1, chunk_tokens=16.0)
    return result.rollout_only_s_per_step


def with_t0(costs: CostModel, t0: float) -> CostModel:
    return dataclasses.replace(costs, decode=DecodeModel(t0_s=t0, t1_s=costs.decode.t1_s))


def fit_t0(costs: CostModel, target: SyncTarget, workload: WorkloadSpec, iters: int = 14) -> float:
    """Bisects t0 (log-scale, t1 held) so that simulated sync rollout time matches the target."""
    lo, hi = 1e-4, 1.0
    for _ in range(iters):
        mid = (lo * hi) ** 0.5
        if sync_rollout_s(with_t0(costs, mid), target.accelerators, workload) < target.rollout_s:
            lo = mid
        else:
            hi = mid
    return (lo * hi) ** 0.5


def calibrate(costs: CostModel, workload: WorkloadSpec, targets: Sequence[SyncTarget]) -> tuple[CostModel, dict]:
    """Fits trainer constants to both targets and t0 to the first; validates on the second."""
    a, b = targets[0], targets[1]
    fixed, per_token = solve_train(a, b, workload)
    costs = dataclasses.replace(costs, train_fixed_s=fixed, train_s_per_token=per_token)
    costs = with_t0(costs, fit_t0(costs, a, workload))
    check = dict(
        fitted_rollout_s=sync_rollout_s(costs, a.accelerators, workload),
        target_rollout_s=a.rollout_s,
        predicted_rollout_s_at_second_size=sync_rollout_s(costs, b.accelerators, workload),
        paper_rollout_s_at_second_size=b.rollout_s,
    )
    return costs, check


def print_calibration(sc) -> None:
    """Fits to the paper's sync rows of sc (its first two settings) and prints config lines."""
    targets = []
    for n in sc.settings[:2]:
        paper = sc.paper[f"gpus_{n}"]
        step_s = paper["step_time_min"]["sync"] * 60.0
        targets.append(SyncTarget(n, step_s, paper["rollout_only_share"]["sync"]))
    costs, check = calibrate(sc.costs, sc.workload, targets)
    print({k: round(v, 1) for k, v in check.items()})
    print(f"c.engine.decode_t0_s = {costs.decode.t0_s:.4g}")
    print(f"c.trainer.train_s_per_token = {costs.train_s_per_token:.4g}")
    print(f"c.trainer.train_fixed_s = {costs.train_fixed_s:.4g}")
