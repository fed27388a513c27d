"""training_loop's reward metrics: what went into a packed batch's rewards and masks, per step."""

import pytest

from dora_jax.core.records import FinishReason, Group, ScoredTrajectory, Trajectory
from dora_jax.runtime.training_loop import reward_metrics
from dora_jax.tasks.reward_shaping import RewardShaping
from dora_jax.trainer.batching import make_train_batch


def sample(tid, n_tokens, reason=FinishReason.EOS, reward=1.0, error=None):
    traj = Trajectory(tid, "g", "p", (1,), (3,) * n_tokens, (-0.5,) * n_tokens, 0, (0,), reason)
    return ScoredTrajectory(traj, reward, error)


GROUP = Group(
    "g",
    0,
    (
        sample("a", 10, FinishReason.LENGTH),  # cut at the cap: penalty -1
        sample("b", 9),  # in the last L_cache tokens: -(9 - 6) / 4 = -0.75
        sample("c", 4, reward=0.0, error="timeout after 10s"),  # failed grade
        sample("d", 0, FinishReason.REJECTED, reward=0.0, error="rejected: prompt too long"),
    ),
)


@pytest.mark.parametrize("overlong_filter", [False, True])
@pytest.mark.parametrize("on_error", [0.0, None])
def test_reward_metrics_count_truncation_penalties_and_failed_grades(overlong_filter, on_error):
    shaping = RewardShaping(max_response_tokens=10, overlong_penalty_tokens=4, reward_on_error=on_error)
    batch = make_train_batch([GROUP], 4, 0, num_rows=6, shaping=shaping, overlong_filter=overlong_filter)
    metrics = reward_metrics(batch)
    valid_penalties = [-1.0, -0.75] + ([0.0] if on_error is not None else [])  # c: valid only when scored
    assert metrics == {
        "reward_errors": 1,  # c, scored or masked; the rejected d is no grading failure
        "truncated_fraction": 0.25,  # 1 of the 4 samples (the 2 padding rows left out)
        "overlong_masked": int(overlong_filter),
        "overlong_penalty_mean": pytest.approx(sum(valid_penalties) / len(valid_penalties)),
    }
