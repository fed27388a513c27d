"""Per-slot token sampling: temperature (0 = greedy), top-k, top-p, one RNG stream per slot.

Shape letters: B slots (batch), V vocab.

Randomness is counter-based: the token that will sit at absolute position `p` of a slot is drawn
with `fold_in(base_key, p)`, where `base_key` comes from the request's seed. A slot's whole RNG
state is therefore its base key, which travels with the slot on migration, and a request that is
migrated, or re-prefilled on the same prompt and prefix, draws exactly the same random numbers as
one that never moved. Two requests with the same seed and prompt draw the same stream: the
dispatcher gives every sample of a group its own seed.

Two log-probs come with every token:
  * `logp`: log softmax of the model's raw logits (temperature 1, no top-k/top-p) at the token.
    This is pi_w(y_t | x, y_<t), the quantity the trainer recomputes with version w's params for
    the importance ratio and the truncated train/inference correction; a temperature- or
    filter-modified value would make that ratio compare two different distributions.
  * `sample_logp`: the log-prob under the distribution actually sampled from (temperature and
    filters applied; 0 for greedy rows), for diagnostics and off-policy corrections that want it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

KEY_IMPL = "threefry2x32"


def base_key_data(seed: int) -> np.ndarray:
    """The raw uint32[2] key data of a request's sampling stream."""
    return np.asarray(jax.random.key_data(jax.random.key(seed, impl=KEY_IMPL)), dtype=np.uint32)


def token_uniforms(key_data_B2: jax.Array, position_B: jax.Array) -> jax.Array:
    """One uniform in [0, 1) per slot, for the token that will occupy `position_B`."""

    def one(key_data_2, position):
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data_2, impl=KEY_IMPL), position)
        return jax.random.uniform(key, (), jnp.float32)

    return jax.vmap(one)(key_data_B2, position_B)


def _inverse_cdf(probs_BV: jax.Array, uniform_B: jax.Array) -> jax.Array:
    """The first token whose cumulative probability exceeds u (exact inverse-CDF sampling).

    One uniform per row instead of Gumbel-max's V: the counter-based RNG then costs B hashes per
    step, not B x V. u is scaled by the row's total so that rounding in the cumsum can never pick
    a token of probability 0 (a filtered one).
    """
    cdf_BV = jnp.cumsum(probs_BV, axis=-1)
    threshold_B = uniform_B * cdf_BV[:, -1]
    index_B = jnp.sum(cdf_BV <= threshold_B[:, None], axis=-1)
    return jnp.minimum(index_B, probs_BV.shape[-1] - 1)


def filter_logits(logits_BV: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
    """Sets logits outside each row's top-k and top-p (nucleus) sets to -inf.

    top_k 0 and top_p 1 disable a filter. Top-p keeps the smallest prefix of the sorted
    distribution whose mass reaches p (always at least the best token). Ties at a threshold keep
    every tied token.
    """
    V = logits_BV.shape[-1]
    sorted_BV = jnp.flip(jnp.sort(logits_BV, axis=-1), axis=-1)
    k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, V), V)
    kth_B = jnp.take_along_axis(sorted_BV, (k_B - 1)[:, None], axis=-1)[:, 0]
    sorted_BV = jnp.where(jnp.arange(V)[None, :] < k_B[:, None], sorted_BV, -jnp.inf)
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    keep_BV = ((mass_before_BV < top_p_B[:, None]) | (top_p_B[:, None] >= 1.0)) & jnp.isfinite(sorted_BV)
    keep_BV = keep_BV.at[:, 0].set(True)
    last_kept_B = jnp.sum(keep_BV, axis=-1) - 1
    pth_B = jnp.take_along_axis(sorted_BV, last_kept_B[:, None], axis=-1)[:, 0]
    threshold_B = jnp.maximum(kth_B, pth_B)
    return jnp.where(logits_BV >= threshold_B[:, None], logits_BV, -jnp.inf)


def sample(
    logits_BV: jax.Array,
    key_data_B2: jax.Array,
    position_B: jax.Array,
    temperature_B: jax.Array,
    top_p_B: jax.Array,
    top_k_B: jax.Array,
    *,
    filters: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(tokens_B, logp_B, sample_logp_B) for the tokens that will occupy `position_B`.

    Rows with temperature 0 take the argmax of the raw logits (HF's greedy rule). The sort behind
    top-k/top-p runs only when some row asks for a filter (`lax.cond`), so plain sampling and
    greedy decoding pay nothing for it. `filters=False` leaves the filter out of the program
    altogether (the caller refuses filtered requests): its sort is costly to compile.
    """
    logits_BV = logits_BV.astype(jnp.float32)
    greedy_B = temperature_B <= 0
    scaled_BV = logits_BV / jnp.where(greedy_B, 1.0, temperature_B)[:, None]
    needs_filter = jnp.any(((top_k_B > 0) | (top_p_B < 1.0)) & ~greedy_B)
    if filters:
        scaled_BV = jax.lax.cond(needs_filter, lambda x: filter_logits(x, top_k_B, top_p_B), lambda x: x, scaled_BV)
    sample_logps_BV = jax.nn.log_softmax(scaled_BV, axis=-1)
    drawn_B = _inverse_cdf(jnp.exp(sample_logps_BV), token_uniforms(key_data_B2, position_B))
    tokens_B = jnp.where(greedy_B, jnp.argmax(logits_BV, axis=-1), drawn_B).astype(jnp.int32)
    logp_B = _take(jax.nn.log_softmax(logits_BV, axis=-1), tokens_B)
    sample_logp_B = jnp.where(greedy_B, 0.0, _take(sample_logps_BV, tokens_B))
    return tokens_B, logp_B, sample_logp_B


def log_prob_of(logits_BV: jax.Array, tokens_B: jax.Array) -> jax.Array:
    """Temperature-1 log-prob of `tokens_B` (used for a custom `sampler`'s picks)."""
    return _take(jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1), tokens_B)


def _take(values_BV, tokens_B):
    return jnp.take_along_axis(values_BV, tokens_B[:, None], axis=-1)[:, 0]
