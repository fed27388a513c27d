"""make_train_batch: alignment of tokens, loss mask and inference log-probs; buckets; masking."""

import numpy as np
import pytest

from dora_jax.core.records import FinishReason, Group, ScoredTrajectory, Trajectory
from dora_jax.tasks.reward_shaping import RewardShaping
from dora_jax.trainer.batching import bucket_length, make_train_batch
from dora_jax.trainer.bucketed import batch_widths


def traj(tid, prompt, response, version, reason=FinishReason.EOS):
    return Trajectory(
        traj_id=tid,
        group_id=tid[0],
        prompt_id=tid[0],
        prompt_ids=tuple(prompt),
        response_ids=tuple(response),
        logprobs=tuple(-0.1 * (i + 1) for i in range(len(response))),
        version=version,
        versions_seen=(version,),
        finish_reason=reason,
    )


GROUPS = [
    Group(
        "a",
        3,
        (
            ScoredTrajectory(traj("a0", [5, 6, 7], [8, 9], 3), 1.0),
            ScoredTrajectory(traj("a1", [5, 6, 7], [10], 3), 0.0, reward_error="timeout"),
        ),
    ),
    Group(
        "b",
        1,
        (
            ScoredTrajectory(traj("b0", [4], [11, 12, 13, 14], 1), 0.5),
            ScoredTrajectory(traj("b1", [4], [], 1, FinishReason.REJECTED), 0.0),
        ),
    ),
]


def test_layout_and_masks():
    batch = make_train_batch(GROUPS, pad_to=4, pad_id=0)
    assert batch.tokens_BT.shape == (4, 8)  # longest row is 5 -> bucket 4 * 2
    np.testing.assert_array_equal(batch.tokens_BT[0], [5, 6, 7, 8, 9, 0, 0, 0])
    np.testing.assert_array_equal(batch.loss_mask_BT[0], [0, 0, 0, 1, 1, 0, 0, 0])
    np.testing.assert_allclose(batch.inference_logps_BT[0], [0, 0, 0, -0.1, -0.2, 0, 0, 0])
    np.testing.assert_array_equal(batch.tokens_BT[2], [4, 11, 12, 13, 14, 0, 0, 0])
    np.testing.assert_array_equal(batch.loss_mask_BT[2], [0, 1, 1, 1, 1, 0, 0, 0])
    # a1's grade failed: scored task.reward_on_error (0 by default) and kept; b1 was rejected: masked
    np.testing.assert_array_equal(batch.valid_B, [1, 1, 1, 0])
    np.testing.assert_array_equal(batch.rewards_B, [1.0, 0.0, 0.5, 0.0])
    np.testing.assert_array_equal(batch.reward_error_B, [0, 1, 0, 0])
    masked = make_train_batch(GROUPS, pad_to=4, pad_id=0, shaping=RewardShaping(reward_on_error=None))
    np.testing.assert_array_equal(masked.valid_B, [1, 0, 1, 0])  # task.reward_on_error = "mask"
    np.testing.assert_array_equal(masked.reward_error_B, [0, 1, 0, 0])
    np.testing.assert_array_equal(batch.versions_B, [3, 3, 1, 1])
    np.testing.assert_array_equal(batch.group_ids_B, [0, 0, 1, 1])
    assert batch.traj_ids == ("a0", "a1", "b0", "b1")


def test_fixed_shapes_with_num_rows_and_bucket():
    batch = make_train_batch(GROUPS, pad_to=16, pad_id=1, num_rows=8)
    assert batch.tokens_BT.shape == (8, 16)
    assert (batch.valid_B[4:] == 0).all() and (batch.loss_mask_BT[4:] == 0).all() and (batch.tokens_BT[4:] == 1).all()
    assert (batch.versions_B[4:] == 3).all() and (batch.group_ids_B[4:] == 2).all()
    assert [bucket_length(n, 16) for n in (1, 16, 17, 33, 64, 65)] == [16, 16, 32, 64, 64, 128]
    with pytest.raises(ValueError, match=r"4 samples do not fit num_rows=2"):
        make_train_batch(GROUPS, pad_to=16, pad_id=0, num_rows=2)


def test_a_batch_is_no_wider_than_the_longest_row_rollout_can_make():
    """Rows of up to 9216 positions pad to 9216, not to the next 512 * 2^k (16384): the trainer
    compiles, and runs, the widths `batch_widths` lists."""
    assert make_train_batch(GROUPS, pad_to=4, pad_id=0, max_length=6).tokens_BT.shape == (4, 6)
    assert make_train_batch(GROUPS, pad_to=4, pad_id=0, max_length=64).tokens_BT.shape == (4, 8)
    assert batch_widths(9216, 512) == (512, 1024, 2048, 4096, 8192, 9216)
    assert batch_widths(1024, 128) == (128, 256, 512, 1024)


def test_overlong_filter_and_soft_punishment():
    """L_max = 4, L_cache = 2: a 4-token response cut at the cap gets -1 and, with the overlong
    filter, no loss tokens (its reward still counts in its group); a 3-token one ending in EOS gets
    -0.5 and keeps its tokens."""
    groups = [
        Group(
            "c",
            0,
            (
                ScoredTrajectory(traj("c0", [5], [8, 9, 10, 11], 0, FinishReason.LENGTH), 1.0),
                ScoredTrajectory(traj("c1", [5], [8, 9, 10], 0), 1.0),
                ScoredTrajectory(traj("c2", [5], [8], 0), 0.0),
            ),
        )
    ]
    shaping = RewardShaping(max_response_tokens=4, overlong_penalty_tokens=2)
    batch = make_train_batch(groups, pad_to=8, pad_id=0, shaping=shaping, overlong_filter=True)
    np.testing.assert_allclose(batch.rewards_B, [0.0, 0.5, 0.0])
    np.testing.assert_allclose(batch.overlong_penalty_B, [-1.0, -0.5, 0.0])
    np.testing.assert_array_equal(batch.truncated_B, [1, 0, 0])
    np.testing.assert_array_equal(batch.valid_B, [1, 1, 1])
    np.testing.assert_array_equal(batch.loss_mask_BT.sum(1), [0, 3, 1])
    np.testing.assert_allclose(batch.inference_logps_BT[0, 1:5], [-0.1, -0.2, -0.3, -0.4])  # still packed
    unfiltered = make_train_batch(groups, pad_to=8, pad_id=0, shaping=shaping)
    np.testing.assert_array_equal(unfiltered.loss_mask_BT.sum(1), [4, 3, 1])
    np.testing.assert_array_equal(unfiltered.rewards_B, batch.rewards_B)
