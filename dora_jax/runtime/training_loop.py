"""The one training loop, shared by the embedded run and the trainer role process.

    take TBS samples from a `BatchSource` (version window) -> pack -> train step (behaviour
    log-probs per generating version) -> publish v+1 -> tell the source (the coordinator applies
    the publish, the ledger gets the step's behaviour digests, old versions retire) -> one
    metrics row.

The source is the in-process coordinator (`dora_jax.runtime.runner`) or the coordinator service over gRPC
(`dora_jax.trainer_worker`); what differs around the loop (checkpoints, fault injection, progress,
logging) comes in through `after_step` and `on_row`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np

from dora_jax.core.records import Group, TrainBatch
from dora_jax.runtime import faults
from dora_jax.runtime.metrics import MetricsWriter
from dora_jax.tasks.reward_shaping import RewardShaping
from dora_jax.trainer import Trainer, make_train_batch

COUNTERS = (
    "slot_steps",
    "idle_slot_steps",
    "generated_tokens",
    "kv_preemptions",
)  # rollout totals; rows show the step's delta
# The coordinator's dynamic-sampling totals (CoordinatorStats); rows show the step's delta as the
# `dynamic_sampling/` metrics.
DYNAMIC_SAMPLING_COUNTERS = ("scored_groups", "filtered_groups", "filtered_samples")


@dataclasses.dataclass(frozen=True)
class TakenBatch:
    groups: Sequence[Group]
    stats: Mapping[str, float]  # at the take: trainer_wait_s(_c3_s), versions_in_flight, migrations_kv, COUNTERS


class BatchSource(Protocol):
    def take(
        self, trainer_version: int, ahead: Callable[[Sequence[Group]], None] | None = None, committed: bool = False
    ) -> TakenBatch | None:
        """Blocks for the batch that takes the trainer from `trainer_version` to the next; None
        when the run is to stop (a preemption) with nothing taken. While it waits, hands
        `ahead` each finished group the batch will hold (once each; oldest first), for the
        trainer to work on meanwhile (`trainer.score_ahead`); with `committed`, only whole groups
        the coordinator commits to that batch (`trainer.grad_ahead`)."""

    def published(self, version: int, behaviour_digests: Mapping[int, str]) -> None:
        """The trainer stored `version`; `behaviour_digests` are the params it recomputed with."""

    def counters(self) -> Mapping[str, float]:
        """The COUNTERS now (the first row's baseline)."""


@dataclasses.dataclass
class LoopResult:
    rows: list[dict]
    train_busy_s: float  # pack + step + publish, and work done while waiting (score_ahead, grad_ahead)
    timeline: list[tuple[float, float, int]]  # (start, end, version trained on) per step
    stopped_early: bool  # the source returned no batch before num_steps


def sizes(config, pad_id: int) -> dict:
    """`train`'s batch-shape and packing arguments from a RunConfig (the same for every caller)."""
    return {
        "num_steps": config.num_steps,
        "batch_rows": config.coordinator.train_batch_size,
        "pad_to": config.pad_to,
        "pad_id": pad_id,
        "max_length": config.rollout.cache_length,
        "shaping": config.reward_shaping,
    }


def train(
    trainer: Trainer,
    source: BatchSource,
    *,
    num_steps: int,
    pad_to: int,
    pad_id: int,
    batch_rows: int | None = None,
    max_length: int | None = None,
    writer: MetricsWriter | None = None,
    after_step: Callable[[int], dict] | None = None,
    on_row: Callable[[dict], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    start: float | None = None,
    shaping: RewardShaping = RewardShaping(),
) -> LoopResult:
    """Trains from the trainer's version to `num_steps`. `after_step(step)` runs once the step is
    published (checkpoints, faults) and returns extra row fields; `on_row(row)` sees each row;
    `should_stop()` (a preemption) ends the loop after a step. `shaping` turns graded rewards into
    training rewards as batches are packed (with the trainer's `overlong_filter`). With
    `trainer.score_ahead` (one-process trainers), the trainer computes behaviour log-probs of the
    groups its next batch will hold while it waits for it; `batch_rows` (the train batch size)
    packs them as that batch is."""
    start = time.perf_counter() if start is None else start
    result = LoopResult([], 0.0, [], stopped_early=False)
    last = dict(source.counters())
    ahead = None
    if trainer.scores_ahead or trainer.grads_ahead:
        if batch_rows is None:
            raise ValueError("trainer.score_ahead and trainer.grad_ahead need batch_rows (the train batch size)")
        ahead = _Ahead(trainer, pad_to, pad_id, batch_rows, max_length, shaping)
    for step in range(trainer.version, num_steps):
        t_take = time.perf_counter()
        if ahead is None:
            taken = source.take(trainer.version)
        else:
            taken = source.take(trainer.version, ahead=ahead, committed=trainer.grads_ahead)
        if taken is None:
            result.stopped_early = True
            break
        t0, wall0 = time.perf_counter(), time.time()
        batch = make_train_batch(
            list(taken.groups),
            pad_to,
            pad_id,
            max_length=max_length,
            shaping=shaping,
            overlong_filter=trainer.config.overlong_filter,
        )
        metrics = trainer.train_step(batch)
        faults.reached("train_step")
        trainer.publish()
        t1 = time.perf_counter()
        result.train_busy_s += t1 - t0
        result.timeline.append((t0, t1, metrics.version - 1))
        source.published(trainer.version, metrics.behaviour_digests)
        row = step_row(step, batch, metrics, taken.stats, last, start, wait_s=t0 - t_take)
        row["train_interval_t"] = [wall0, wall0 + (t1 - t0)]  # wall clock: lines up with other processes
        if ahead is not None:  # behaviour log-probs or gradients computed while waiting for this batch
            result.train_busy_s += ahead.seconds
            row["grad_ahead_s" if trainer.grads_ahead else "score_ahead_s"], ahead.seconds = ahead.seconds, 0.0
        last = dict(taken.stats)
        if after_step is not None:
            row.update(after_step(step) or {})
        result.rows.append(row)
        if writer is not None:
            writer.write(step, row, {"staleness": [k for k, v in metrics.staleness.items() for _ in range(v)]})
        if on_row is not None:
            on_row(row)
        if should_stop is not None and should_stop() and step + 1 < num_steps:
            result.stopped_early = True
            break
    return result


class _Ahead:
    """`trainer.score_ahead` / `trainer.grad_ahead`: packs the groups a take hands over while it
    waits as a training batch would be packed (the same reward shaping), and has the trainer
    compute their behaviour log-probs, or their gradients. Gradients are computed a whole
    micro-batch at a time (`Trainer.grad_ahead`'s `full_only`): the groups committed so far to the
    batch are packed again with each new commit, until the take."""

    def __init__(self, trainer: Trainer, pad_to: int, pad_id: int, batch_rows: int, max_length: int | None, shaping):
        self._trainer, self._pad_to, self._pad_id = trainer, pad_to, pad_id
        self._rows, self._max_length, self._shaping = batch_rows, max_length, shaping
        self.seconds = 0.0  # spent computing since the last step's row
        self._committed: tuple[int, list[Group]] = (-1, [])  # (trainer version, groups committed to its batch)

    def __call__(self, groups: Sequence[Group]) -> None:
        start = time.perf_counter()
        if self._trainer.grads_ahead:
            version = self._trainer.version
            earlier = self._committed[1] if self._committed[0] == version else []
            groups = earlier + list(groups)
            self._committed = (version, groups)
        part, rows = [], 0  # a take hands over at most a batch; more is packed as several
        for group in groups:
            if part and rows + len(group.samples) > self._rows:
                self._score(part)
                part, rows = [], 0
            part.append(group)
            rows += len(group.samples)
        if part:
            self._score(part)
        self.seconds += time.perf_counter() - start

    def _score(self, groups: list[Group]) -> None:
        batch = make_train_batch(
            groups,
            self._pad_to,
            self._pad_id,
            num_rows=self._rows,
            max_length=self._max_length,
            shaping=self._shaping,
            overlong_filter=self._trainer.config.overlong_filter,
        )
        if self._trainer.grads_ahead:
            self._trainer.grad_ahead(batch, full_only=True)
        else:
            self._trainer.score_ahead(batch)


def step_row(
    step: int,
    batch: TrainBatch,
    metrics,
    stats: Mapping[str, float],
    last: Mapping[str, float],
    start: float,
    wait_s: float,
) -> dict:
    """One metrics row: the batch, the step's metrics, and the rollout counters since the last row."""
    delta = {k: stats.get(k, 0) - last.get(k, 0) for k in COUNTERS}
    valid = batch.valid_B > 0
    wall = time.perf_counter() - start
    row = {
        "reward_mean": float(batch.rewards_B[valid].mean()) if valid.any() else float("nan"),
        "valid_fraction": float(valid.mean()),
        "staleness_max": int(max(metrics.staleness)),
        "versions_in_flight": stats.get("versions_in_flight", 0),
        "trainer_wait_s": stats.get("trainer_wait_s", 0.0),
        "trainer_wait_c3_s": stats.get("trainer_wait_c3_s", 0.0),  # of it, C3 holding a queued batch
        "take_batch_s": wait_s,
        "bubble_ratio": delta["idle_slot_steps"] / delta["slot_steps"] if delta["slot_steps"] else 0.0,
        "generated_tokens": delta["generated_tokens"],
        "kv_preemptions": delta["kv_preemptions"],  # requests the paged KV pool sent back to re-prefill
        "wall_s": wall,
        "response_len_mean": float(batch.loss_mask_BT.sum(1).mean()),
        "migrations_kv": stats.get("migrations_kv", 0),
        "migrations_reprefill": stats.get("migrations_reprefill", 0),
    }
    row.update(dynamic_sampling_row(stats, last, sum(1 for t in batch.traj_ids if t)))  # "": padding rows
    row.update(reward_metrics(batch))
    row.update({k: v for k, v in metrics.as_dict().items() if not k.startswith("staleness/")})
    row["train_tokens_per_s"] = row.pop("tokens_per_s")
    row["tokens_per_s"] = float(batch.loss_mask_BT.sum()) / max(wall / (step + 1), 1e-9)
    return row


def dynamic_sampling_row(stats: Mapping[str, float], last: Mapping[str, float], trained: int) -> dict:
    """The step's dynamic-sampling metrics, from the coordinator's totals at this take and the last:
    the fraction of the training groups completed since then that were filtered (no reward variance),
    and the samples generated but filtered per sample trained on (DAPO's over-sampling cost)."""
    delta = {k: stats.get(k, 0) - last.get(k, 0) for k in DYNAMIC_SAMPLING_COUNTERS}
    return {
        "dynamic_sampling/filtered_groups": delta["filtered_groups"],
        "dynamic_sampling/filtered_fraction": (
            delta["filtered_groups"] / delta["scored_groups"] if delta["scored_groups"] else 0.0
        ),
        "dynamic_sampling/extra_samples_per_trained": delta["filtered_samples"] / trained if trained else 0.0,
    }


def reward_metrics(batch: TrainBatch) -> dict:
    """What went into the batch's rewards and masks (dora_jax.tasks.reward_shaping), over its
    samples (padding rows left out); {} for a batch built without that record."""
    if batch.truncated_B is None or batch.overlong_penalty_B is None or batch.reward_error_B is None:
        return {}
    real = np.asarray([bool(t) for t in batch.traj_ids])
    valid = (batch.valid_B > 0) & real
    truncated = (batch.truncated_B > 0) & real
    return {
        "reward_errors": int(((batch.reward_error_B > 0) & real).sum()),  # failed grades, scored or masked
        "truncated_fraction": float(truncated.sum() / max(real.sum(), 1)),  # cut at rollout.max_new_tokens
        # truncated samples without loss tokens (trainer.overlong_filter; a truncated response is never empty)
        "overlong_masked": int((truncated & (batch.loss_mask_BT.sum(1) == 0)).sum()),
        "overlong_penalty_mean": float(batch.overlong_penalty_B[valid].mean()) if valid.any() else 0.0,
    }
