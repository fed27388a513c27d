"""Group-relative advantage estimators and DAPO dynamic sampling (pure, jit-friendly).

Shape letters: B samples. `group_ids_B` index the groups of one batch (0 <= id < B); only valid
samples (valid_B = 1) enter a group's statistics, and invalid ones get advantage 0.

For group g with valid samples i = 1..n and rewards R_i (mean mu_g):
  grpo     A_i = (R_i - mu_g) / (sigma_g + eps),  sigma_g the unbiased std (ddof = 1)
  dr_grpo  A_i = R_i - mu_g                         (Dr.GRPO: no std scaling)
  rloo     A_i = R_i - (sum_{j != i} R_j) / (n - 1) = n / (n - 1) * (R_i - mu_g)
A group with n < 2 has no baseline: its advantages are 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def _group_sum(x_B, group_ids_B):
    sums_G = jax.ops.segment_sum(x_B, group_ids_B, num_segments=x_B.shape[0])
    return sums_G[group_ids_B]


def group_advantages(
    rewards_B: jax.Array, group_ids_B: jax.Array, valid_B: jax.Array, estimator: str, eps: float = 1e-6
) -> jax.Array:
    """Advantages of each sample relative to its group (see the module docstring)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"advantage estimator {estimator!r}; expected one of {ESTIMATORS}")
    valid_B = valid_B.astype(jnp.float32)
    rewards_B = jnp.where(valid_B > 0, rewards_B.astype(jnp.float32), 0.0)
    n_B = _group_sum(valid_B, group_ids_B)
    mean_B = _group_sum(rewards_B, group_ids_B) / jnp.maximum(n_B, 1.0)
    centred_B = (rewards_B - mean_B) * valid_B
    if estimator == "grpo":
        var_B = _group_sum(centred_B**2, group_ids_B) / jnp.maximum(n_B - 1.0, 1.0)
        adv_B = centred_B / (jnp.sqrt(var_B) + eps)
    elif estimator == "dr_grpo":
        adv_B = centred_B
    else:  # rloo
        adv_B = centred_B * n_B / jnp.maximum(n_B - 1.0, 1.0)
    return jnp.where((n_B >= 2) & (valid_B > 0), adv_B, 0.0)


def informative_samples(rewards_B: jax.Array, group_ids_B: jax.Array, valid_B: jax.Array):
    """DAPO dynamic sampling: (keep_B, dropped_groups).

    A group whose valid rewards are all equal (all correct or all wrong) has zero advantage and
    only dilutes the token normalisation; its samples are masked out (keep_B = 0) and counted.
    Masking rather than dropping keeps the batch shape fixed; refilling the batch with other
    groups is the coordinator's business.
    """
    B = rewards_B.shape[0]
    valid = valid_B > 0
    rewards_B = rewards_B.astype(jnp.float32)
    high_G = jax.ops.segment_max(jnp.where(valid, rewards_B, -jnp.inf), group_ids_B, num_segments=B)
    low_G = jax.ops.segment_min(jnp.where(valid, rewards_B, jnp.inf), group_ids_B, num_segments=B)
    has_valid_G = jax.ops.segment_sum(valid.astype(jnp.int32), group_ids_B, num_segments=B) > 0
    flat_G = has_valid_G & (high_G == low_G)
    keep_B = valid & ~flat_G[group_ids_B]
    return keep_B, flat_G.sum()
