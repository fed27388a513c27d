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
    kept = np.isfinite(np.asarray(sampling.filter_logits(logits_BV, top_k_B, top_p_B)))
    assert kept.tolist() == [[True, True, False, False],  # top-2
                             [True, True, False, False],  # 0.5 + 0.25 >= 0.7
                             [True, True, True, False],  # needs 0.9 >= 0.8
                             [True, False, False, False]]


def _draw(n, temperature=1.0, top_p=1.0, top_k=0, logits=LOGITS):
    """n draws from one slot's stream, at positions 0..n-1."""
    key_B2 = jnp.asarray(np.tile(sampling.base_key_data(7), (n, 1)))
    return jax.jit(sampling.sample)(jnp.asarray(np.tile(logits, (n, 1))), key_B2, jnp.arange(n, dtype=jnp.int32),
                                    jnp.full((n,), temperature), jnp.full((n,), top_p), jnp.full((n,), top_k, jnp.int32))


def test_draws_follow_the_distribution_and_log_probs_are_temperature_one():
    tokens, logp, sample_logp = map(np.asarray, _draw(8000))
    freq = np.bincount(tokens, minlength=4) / len(tokens)
    np.testing.assert_allclose(freq, np.exp(LOGITS), atol=0.02)
    np.testing.assert_allclose(logp, LOGITS[tokens], atol=1e-6)
    np.testing.assert_allclose(sample_logp, LOGITS[tokens], atol=1e-6)

    tokens, logp, sample_logp = map(np.asarray, _draw(8000, temperature=0.5, top_k=3))
    sharpened = np.exp(2 * LOGITS[:3]) / np.exp(2 * LOGITS[:3]).sum()
    np.testing.assert_allclose(np.bincount(tokens, minlength=4)[:3] / len(tokens), sharpened, atol=0.02)
    assert (tokens < 3).all()
    np.testing.assert_allclose(logp, LOGITS[tokens], atol=1e-6)  # the model's, not the sampler's
    np.testing.assert_allclose(sample_logp, np.log(sharpened)[tokens], atol=1e-5)


def test_greedy_is_argmax_and_streams_are_counter_based():
    tokens, logp, sample_logp = map(np.asarray, _draw(16, temperature=0.0))
    assert (tokens == 0).all() and (sample_logp == 0).all()
    np.testing.assert_allclose(logp, LOGITS[0], atol=1e-6)
    first, again = np.asarray(_draw(64)[0]), np.asarray(_draw(64)[0])
    assert (first == again).all() and len(set(first.tolist())) > 1  # same key + position: same draw
