"""Sampling: filters, greedy rule, log-probs, and that draws follow the intended distribution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dora_jax.rollout import sampling

LOGITS = np.log(np.array([0.5, 0.25, 0.15, 0.1], np.float32))


def test_filters_keep_the_top_k_and_the_nucleus():
    logits_BV = jnp.asarray(np.stack([LOGITS] * 4))
    top_k_B = jnp.array([2, 0, 0, 1])
    top_p_B = jnp.array([1.0, 0.7, 0.8, 1.0])
    kept = np.isfinite(np.asarray(jax.jit(sampling.filter_logits)(logits_BV, top_k_B, top_p_B)))
    assert kept.tolist() == [
        [True, True, False, False],  # top-2
        [True, True, False, False],  # 0.5 + 0.25 >= 0.7
        [True, True, True, False],  # needs 0.9 >= 0.8
        [True, False, False, False],
    ]


_SAMPLE = jax.jit(sampling.sample)
N = 8000


def _draw(temperature=1.0, top_p=1.0, top_k=0):
    """N draws from one slot's stream, at positions 0..N-1 (one compiled program for every call)."""
    key_B2 = jnp.asarray(np.tile(sampling.base_key_data(7), (N, 1)))
    return _SAMPLE(
        jnp.asarray(np.tile(LOGITS, (N, 1))),
        key_B2,
        jnp.arange(N, dtype=jnp.int32),
        jnp.full((N,), temperature, jnp.float32),
        jnp.full((N,), top_p, jnp.float32),
        jnp.full((N,), top_k, jnp.int32),
    )


def test_draws_follow_the_distribution_and_log_probs_are_temperature_one():
    tokens, logp, sample_logp = map(np.asarray, _draw())
    freq = np.bincount(tokens, minlength=4) / len(tokens)
    np.testing.assert_allclose(freq, np.exp(LOGITS), atol=0.02)
    np.testing.assert_allclose(logp, LOGITS[tokens], atol=1e-6)
    np.testing.assert_allclose(sample_logp, LOGITS[tokens], atol=1e-6)

    tokens, logp, sample_logp = map(np.asarray, _draw(temperature=0.5, top_k=3))
    sharpened = np.exp(2 * LOGITS[:3]) / np.exp(2 * LOGITS[:3]).sum()
    np.testing.assert_allclose(np.bincount(tokens, minlength=4)[:3] / len(tokens), sharpened, atol=0.02)
    assert (tokens < 3).all()
    np.testing.assert_allclose(logp, LOGITS[tokens], atol=1e-6)  # the model's, not the sampler's
    np.testing.assert_allclose(sample_logp, np.log(sharpened)[tokens], atol=1e-5)


def test_greedy_is_argmax_and_streams_are_counter_based():
    tokens, logp, sample_logp = map(np.asarray, _draw(temperature=0.0))
    assert (tokens == 0).all() and (sample_logp == 0).all()
    np.testing.assert_allclose(logp, LOGITS[0], atol=1e-6)
    first, again = np.asarray(_draw()[0]), np.asarray(_draw()[0])
    assert (first == again).all() and len(set(first.tolist())) > 1  # same key + position: same draw
