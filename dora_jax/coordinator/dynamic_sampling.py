"""DAPO's dynamic sampling on the coordinator: groups that cannot train are filtered, more are drawn.

A group whose valid rewards are all equal (all right or all wrong, or fewer than two valid
samples) has zero advantage under every estimator (dora_jax/trainer/advantages.py): trained on,
it only dilutes the token normalisation, and the batch's useful size shrinks as the policy
improves. DAPO over-samples and keeps drawing until the batch holds TBS samples of groups with
reward variance. The coordinator knows a group's rewards as soon as its last sample is scored,
before the trainer can take it, so with `dynamic_sampling` on such a group is filtered there:
written to the ledger (`filtered`, a terminal state as `consume` is: the audit counts it
accounted for, C2), never put in the TransferQueue, and replaced:
  - streaming modes (dora, partial_rollout): by `_supply` itself, as the filtered samples leave
    the unconsumed count it keeps topped up (RBS in flight, the window's takes x TBS unconsumed);
  - sync and one_step_off: one new group per filtered group, at the newest version, at once: their
    supply triggers only at a publish or a take, and the take waits for exactly TBS samples (sync
    waits for enough informative groups, as DAPO does; nothing extra is made that a later step
    would train on too stale).
A run whose prompts all saturate would draw forever: `FilterBudget` stops it with a clear error
after `max_filtered_batches_per_step` batches' worth of groups filtered between two takes.

Every completed training group's rewards go to the ledger (`score`), with dynamic sampling on or
off, so the auditor checks each consumed group's variance from the ledger alone. Evaluation
groups are never filtered (they never reach a group). The trainer keeps its own mask
(`advantages.informative_samples`) as a safety net: it zeroes what this filter let through only
where the two disagree (a sample masked by the trainer alone, or rewards equal in float32 only).
"""

from __future__ import annotations

from collections.abc import Sequence

from dora_jax.coordinator.config import CoordinatorConfig
from dora_jax.core.records import FinishReason, Group, ScoredTrajectory

NO_VALID_REWARD = "no valid reward"  # every sample's reward failed or its request was rejected
ONE_VALID_REWARD = "one valid reward"  # a group of one valid sample has no variance
ALL_REWARDS_EQUAL = "all rewards equal"


def why_uninformative(rewards: Sequence[float], valid: Sequence[bool]) -> str | None:
    """Why a group with these rewards cannot train (None: its valid rewards vary). Masked samples
    (`valid` False) do not count, as they do not in the trainer's advantages."""
    if len(rewards) != len(valid):
        raise ValueError(f"{len(rewards)} rewards but {len(valid)} validity flags")
    kept = [float(r) for r, ok in zip(rewards, valid) if ok]
    if not kept:
        return NO_VALID_REWARD
    if len(kept) == 1:
        return ONE_VALID_REWARD
    if len(set(kept)) == 1:
        return ALL_REWARDS_EQUAL
    return None


def counted(sample: ScoredTrajectory, reward_on_error: float | None) -> tuple[float, bool]:
    """(reward, counts) of a sample as the trainer sees it: a failed grade scores `reward_on_error`
    (task.reward_on_error) and counts, or is masked (None, "mask"); a rejected request never counts."""
    if sample.reward_error is not None and reward_on_error is not None:
        return float(reward_on_error), sample.trajectory.finish_reason != FinishReason.REJECTED
    return float(sample.reward), sample.valid


def score_event(group: Group, reward_on_error: float | None = None) -> dict:
    """The ledger's `score` fields of a whole, scored group: its samples in order with their
    rewards and whether each counts, as the trainer counts them (`counted`)."""
    scores = [counted(s, reward_on_error) for s in group.samples]
    return {
        "group": group.group_id,
        "version": group.version,
        "trajs": [s.trajectory.traj_id for s in group.samples],
        "rewards": [reward for reward, _ in scores],
        "valid": [ok for _, ok in scores],
    }


def why_filtered(group: Group, reward_on_error: float | None = None) -> str | None:
    scores = [counted(s, reward_on_error) for s in group.samples]
    return why_uninformative([reward for reward, _ in scores], [ok for _, ok in scores])


class FilterBudget:
    """Groups filtered since the trainer's last take, against `max_filtered_batches_per_step`
    batches of TBS / G groups (0: no limit). A checkpoint keeps the count (`since_take`)."""

    def __init__(self, config: CoordinatorConfig):
        self._config = config
        self.limit = config.max_filtered_batches_per_step * (config.train_batch_size // config.group_size)
        self.since_take = 0

    def spend(self, taken_at: int) -> None:
        """One more group filtered; raises once more were filtered than the limit allows."""
        self.since_take += 1
        if self.limit and self.since_take > self.limit:
            cfg = self._config
            per_batch = cfg.train_batch_size // cfg.group_size
            since = f"since the trainer's take at version {taken_at}" if taken_at >= 0 else "before the first take"
            raise RuntimeError(
                f"dynamic sampling: {self.since_take} groups filtered (no reward variance) {since}, more than "
                f"coordinator.max_filtered_batches_per_step={cfg.max_filtered_batches_per_step} batches "
                f"of {per_batch} groups: the prompts are saturated for this policy (every answer right, or every "
                "answer wrong). Use prompts of fitting difficulty, raise the limit (0: no limit), or set "
                "trainer.dynamic_sampling=False"
            )

    def taken(self) -> None:
        self.since_take = 0
