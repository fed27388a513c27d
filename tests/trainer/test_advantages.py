"""Advantage estimators and DAPO dynamic sampling against a NumPy reference."""

import numpy as np
import pytest

from dora_jax.trainer.advantages import ESTIMATORS, group_advantages, informative_samples

REWARDS = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.2, 0.9, 7.0, 3.0, 1.0], np.float32)
GROUPS = np.array([0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3], np.int32)
VALID = np.array([1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 0], np.float32)  # group 3 has one valid sample


def reference(estimator):
    out = np.zeros_like(REWARDS)
    for g in np.unique(GROUPS):
        idx = np.flatnonzero((GROUPS == g) & (VALID > 0))
        if idx.size < 2:
            continue
        r = REWARDS[idx].astype(np.float64)
        for k, i in enumerate(idx):
            if estimator == "grpo":
                out[i] = (r[k] - r.mean()) / (r.std(ddof=1) + 1e-6)
            elif estimator == "dr_grpo":
                out[i] = r[k] - r.mean()
            else:
                out[i] = r[k] - np.delete(r, k).mean()
    return out


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_estimators(estimator):
    got = np.asarray(group_advantages(REWARDS, GROUPS, VALID, estimator))
    np.testing.assert_allclose(got, reference(estimator), rtol=1e-5, atol=1e-6)
    assert got[9] == 0 and got[10] == 0 and got[11] == 0  # invalid, or alone in its group


def test_dynamic_sampling_masks_zero_variance_groups():
    keep, dropped = informative_samples(REWARDS, GROUPS, VALID)
    # group 1 is all 1.0; group 3 has a single valid sample (zero variance); group 2 ignores its invalid 7.0
    np.testing.assert_array_equal(np.asarray(keep), [1, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0])
    assert int(dropped) == 2  # groups 1 and 3


def test_unknown_estimator():
    with pytest.raises(ValueError, match=r"advantage estimator 'ppo'; expected one of"):
        group_advantages(REWARDS, GROUPS, VALID, "ppo")
