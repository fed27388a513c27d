"""A graded sample's training reward: DAPO's soft overlong punishment and what a failed grade counts for.

The grader's own result (`ScoredTrajectory.reward`, `.reward_error`) is what the coordinator
records in the ledger and what dynamic sampling looks at (DAPO filters groups on accuracy, before
the length penalty). When the trainer packs a batch (`dora_jax.trainer.batching.make_train_batch`)
each sample's reward becomes

    r_train = (task.reward_on_error if the grade failed else r_grader) + R_length(|y|)

with DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), L_max = rollout.max_new_tokens and
L_cache = task.overlong_penalty_tokens (0: off):

    R_length(|y|) = 0                                  |y| <= L_max - L_cache
                    ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
                    -1                                 L_max < |y|

A failed grade (a timeout, an exception, a non-number) scores `task.reward_on_error` and the sample
stays in the loss, as verl scores a timeout 0; "mask" keeps it out of the loss instead (valid = 0).
A request refused at admission (finish reason "rejected") is always masked: nothing was sampled.
"""

from __future__ import annotations

import dataclasses
import numbers

from dora_jax.core.records import FinishReason, ScoredTrajectory

MASK = "mask"  # task.reward_on_error: a failed grade is masked from the loss


def overlong_penalty(num_tokens: int, max_tokens: int, cache_tokens: int) -> float:
    """R_length(|y|) of the module docstring; 0 when `cache_tokens` is 0 (off)."""
    if cache_tokens <= 0:
        return 0.0
    free = max_tokens - cache_tokens
    if num_tokens <= free:
        return 0.0
    if num_tokens <= max_tokens:
        return (free - num_tokens) / cache_tokens
    return -1.0


def parse_reward_on_error(value) -> float | None:
    """task.reward_on_error: a finite number (the failed sample's reward) or "mask" (None)."""
    if value == MASK:
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and abs(float(value)) < float("inf"):
        return float(value)
    raise ValueError(
        f"task.reward_on_error={value!r}; expected a finite number (the reward of a sample whose grading "
        f"failed, e.g. 0.0) or {MASK!r} (mask it from the loss)"
    )


@dataclasses.dataclass(frozen=True)
class ShapedReward:
    """One sample's training reward and what went into it (for the step's metrics)."""

    reward: float  # r_train (0 when not valid)
    valid: bool  # in the loss and the group statistics
    penalty: float  # R_length added (0 when not valid)
    reward_error: bool  # grading failed (scored task.reward_on_error, or masked)
    truncated: bool  # cut at the response cap (finish reason "length")


@dataclasses.dataclass(frozen=True)
class RewardShaping:
    """The task's reward fields that act when a batch is packed (see the module docstring)."""

    max_response_tokens: int = 0  # L_max: rollout.max_new_tokens
    overlong_penalty_tokens: int = 0  # L_cache: task.overlong_penalty_tokens; 0 = no length penalty
    reward_on_error: float | None = 0.0  # task.reward_on_error; None = "mask"

    def __post_init__(self):
        if self.overlong_penalty_tokens < 0 or self.overlong_penalty_tokens > max(self.max_response_tokens, 0):
            raise ValueError(
                f"task.overlong_penalty_tokens={self.overlong_penalty_tokens}; expected 0 (off) or at most "
                f"rollout.max_new_tokens={self.max_response_tokens} (DAPO's L_cache: the last tokens before the cap)"
            )
        if self.reward_on_error is not None:
            parse_reward_on_error(self.reward_on_error)

    def shape(self, scored: ScoredTrajectory) -> ShapedReward:
        """`scored`'s training reward."""
        traj = scored.trajectory
        truncated = traj.finish_reason == FinishReason.LENGTH
        if traj.finish_reason == FinishReason.REJECTED:
            return ShapedReward(0.0, False, 0.0, reward_error=False, truncated=False)
        failed = scored.reward_error is not None
        if failed and self.reward_on_error is None:
            return ShapedReward(0.0, False, 0.0, reward_error=True, truncated=truncated)
        base = self.reward_on_error if failed else scored.reward
        penalty = overlong_penalty(traj.num_tokens, self.max_response_tokens, self.overlong_penalty_tokens)
        return ShapedReward(base + penalty, True, penalty, reward_error=failed, truncated=truncated)
