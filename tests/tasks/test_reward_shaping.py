"""reward_shaping: DAPO's soft overlong punishment against a numpy reference, golden values, and
what a failed grade counts for (task.reward_on_error)."""

import numpy as np
import pytest

from dora_jax.core.records import FinishReason, ScoredTrajectory, Trajectory
from dora_jax.tasks.reward_shaping import RewardShaping, overlong_penalty, parse_reward_on_error


def reference_penalty(lengths: np.ndarray, l_max: int, l_cache: int) -> np.ndarray:
    """DAPO (Yu et al. 2025) eq. 13, vectorised: 0, then linear from 0 to -1 over the last L_cache
    tokens, then -1 past the cap."""
    free = l_max - l_cache
    ramp = (free - lengths.astype(np.float64)) / l_cache
    return np.select([lengths <= free, lengths <= l_max], [0.0, ramp], -1.0)


def test_overlong_penalty_equals_the_numpy_reference_and_golden_values():
    lengths = np.arange(0, 8300)
    want = reference_penalty(lengths, 8192, 1536)
    got = np.array([overlong_penalty(int(n), 8192, 1536) for n in lengths])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    # Golden: the paper's L_max = 20480, L_cache = 4096 (the punishment starts after 16384 tokens).
    golden = {16384: 0.0, 16385: -1 / 4096, 18432: -0.5, 20479: -4095 / 4096, 20480: -1.0, 20481: -1.0, 100: 0.0}
    for n, value in golden.items():
        assert overlong_penalty(n, 20480, 4096) == pytest.approx(value, abs=1e-15), n
    assert overlong_penalty(20480, 20480, 0) == 0.0  # L_cache 0: off


def scored(n_tokens, reason=FinishReason.EOS, reward=1.0, error=None):
    traj = Trajectory("t", "g", "p", (1, 2), tuple(range(n_tokens)), (-0.5,) * n_tokens, 0, (0,), reason)
    return ScoredTrajectory(traj, reward, error)


def test_shape_adds_the_penalty_and_scores_or_masks_failed_grades():
    shaping = RewardShaping(max_response_tokens=100, overlong_penalty_tokens=20, reward_on_error=0.0)
    short, ramp, cut = (
        shaping.shape(scored(50)),
        shaping.shape(scored(90)),
        shaping.shape(scored(100, FinishReason.LENGTH)),
    )
    assert (short.reward, short.penalty, short.valid, short.truncated) == (1.0, 0.0, True, False)
    assert (ramp.reward, ramp.penalty) == (pytest.approx(0.5), pytest.approx(-0.5))
    assert (cut.reward, cut.penalty, cut.truncated) == (0.0, -1.0, True)
    # A failed grade (timeout) scores reward_on_error, stays valid, and is still length-penalised.
    failed = shaping.shape(scored(90, reward=0.0, error="timeout after 10s"))
    assert (failed.reward, failed.valid, failed.reward_error) == (pytest.approx(-0.5), True, True)
    scored_one = RewardShaping(max_response_tokens=100, reward_on_error=-1.0).shape(scored(10, reward=0.0, error="x"))
    assert (scored_one.reward, scored_one.valid) == (-1.0, True)
    masked = RewardShaping(max_response_tokens=100, reward_on_error=None).shape(scored(90, reward=0.0, error="x"))
    assert (masked.reward, masked.valid, masked.reward_error, masked.penalty) == (0.0, False, True, 0.0)
    # Refused at admission: always masked, not a reward error.
    rejected = shaping.shape(scored(0, FinishReason.REJECTED, reward=0.0, error="rejected: too long"))
    assert (rejected.valid, rejected.reward_error, rejected.reward) == (False, False, 0.0)


def test_bad_fields_are_refused_by_name():
    assert parse_reward_on_error("mask") is None
    assert parse_reward_on_error(0) == 0.0 and parse_reward_on_error(-0.5) == -0.5
    for bad in ("zero", True, float("nan"), float("inf"), None, [0.0]):
        with pytest.raises(ValueError, match=r"task.reward_on_error=.*; expected a finite number .* or 'mask'"):
            parse_reward_on_error(bad)
    with pytest.raises(ValueError, match=r"task.overlong_penalty_tokens=200; expected 0 \(off\) or at most "):
        RewardShaping(max_response_tokens=100, overlong_penalty_tokens=200)
    with pytest.raises(ValueError, match=r"task.overlong_penalty_tokens=-1"):
        RewardShaping(max_response_tokens=100, overlong_penalty_tokens=-1)
