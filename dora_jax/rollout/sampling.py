"""Per-slot token sampling: temperature (0 = greedy), top-k, top-p, one RNG stream per slot.

Shape letters: B slots (batch), V vocab, S vocab shards, Vs = V / S entries per shard.

Randomness is counter-based: the token that will sit at absolute position `p` of a slot is drawn
with `fold_in(base_key, p)`, where `base_key` comes from the request's seed. A slot's whole RNG
state is therefore its base key, which travels with the slot on migration, and a request that is
migrated, or re-prefilled on the same prompt and prefix, draws exactly the same random numbers as
one that never moved. Two requests with the same seed and prompt draw the same stream: the
dispatcher gives every sample of a group its own seed.

Two log-probs come with every token:
  * `logp`: log softmax of the logits divided by the row's temperature (1 for greedy rows), with
    no top-k/top-p, at the token. This is pi_w(y_t | x, y_<t) at the sampling temperature, the
    quantity the trainer recomputes with version w's params (`TrainerConfig.temperature`, the same
    logits / T) for the importance ratio and the truncated train/inference correction: engine and
    trainer compare one distribution. The filters are left out on both sides (a training run with
    them states so: `trainer.truncated_sampling_ratio`).
  * `sample_logp`: the log-prob under the distribution actually sampled from (temperature and
    filters applied; 0 for greedy rows), for diagnostics and off-policy corrections that want it.

Vocab-parallel sampling: when the caller traces under a mesh and rule table
(`parallel.sharding.activation_layout`) that split `vocab` over devices, `sample` runs the same
rule shard by shard under `shard_map`, so no device gathers the [B, V] logits (a tensor-parallel
decode step would otherwise all-gather f32[B, V] twice and run the cumsum on every chip). Only
B-sized values cross devices: the max and the softmax normaliser, each shard's probability mass,
the chosen token and its log-probs. The tokens are the unsharded rule's for the same uniform; the
floats differ only in summation order. Top-k/top-p filtering is the exception: its threshold still
comes from the gathered rows (see `_filter_shard`), in the programs that compile filters, and only
on steps where some row asks for one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import spmd
from jax.sharding import PartitionSpec

from dora_jax.parallel import sharding as sharding_lib

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
    threshold_B = _filter_threshold(logits_BV, top_k_B, top_p_B)
    return jnp.where(logits_BV >= threshold_B[:, None], logits_BV, -jnp.inf)


def _filter_threshold(logits_BV: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
    """The smallest logit each row's filters keep (a sort over the whole vocabulary)."""
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
    return jnp.maximum(kth_B, pth_B)


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
    """(tokens_B, logp_B, sample_logp_B) for the tokens that will occupy `position_B`: `logp` at
    the row's temperature without filters, `sample_logp` with them (see the module docstring).

    Rows with temperature 0 take the argmax of the raw logits (HF's greedy rule). The sort behind
    top-k/top-p runs only when some row asks for a filter (`lax.cond`), so plain sampling and
    greedy decoding pay nothing for it. `filters=False` leaves the filter out of the program
    altogether (the caller refuses filtered requests): its sort is costly to compile.

    Under a mesh and rule table that split `vocab` (see the module docstring) this runs shard by
    shard (`_sample_sharded`); otherwise over the whole row, as below.
    """
    logits_BV = logits_BV.astype(jnp.float32)
    greedy_B = temperature_B <= 0
    needs_filter = jnp.any(((top_k_B > 0) | (top_p_B < 1.0)) & ~greedy_B)
    layout = _vocab_layout(logits_BV.shape)
    if layout is not None:
        uniform_B = token_uniforms(key_data_B2, position_B)
        rows = (temperature_B, top_p_B, top_k_B)
        return _sample_sharded(*layout, logits_BV, uniform_B, rows, needs_filter if filters else None)
    unfiltered_BV = logits_BV / jnp.where(greedy_B, 1.0, temperature_B)[:, None]
    scaled_BV = unfiltered_BV
    if filters:
        scaled_BV = jax.lax.cond(needs_filter, lambda x: filter_logits(x, top_k_B, top_p_B), lambda x: x, scaled_BV)
    sample_logps_BV = jax.nn.log_softmax(scaled_BV, axis=-1)
    drawn_B = _inverse_cdf(jnp.exp(sample_logps_BV), token_uniforms(key_data_B2, position_B))
    tokens_B = jnp.where(greedy_B, jnp.argmax(logits_BV, axis=-1), drawn_B).astype(jnp.int32)
    logp_B = _take(jax.nn.log_softmax(unfiltered_BV, axis=-1), tokens_B)
    sample_logp_B = jnp.where(greedy_B, 0.0, _take(sample_logps_BV, tokens_B))
    return tokens_B, logp_B, sample_logp_B


def log_prob_of(logits_BV: jax.Array, tokens_B: jax.Array) -> jax.Array:
    """Temperature-1 log-prob of `tokens_B` (used for a custom `sampler`'s picks)."""
    return _take(jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1), tokens_B)


def _take(values_BV, tokens_B):
    return jnp.take_along_axis(values_BV, tokens_B[:, None], axis=-1)[:, 0]


# ---------------------------------------------------------------- vocab-parallel sampling


def _vocab_layout(shape_BV) -> tuple[jax.sharding.AbstractMesh, PartitionSpec] | None:
    """(mesh, spec of the [B, V] logits) when the mesh and rules in context (`activation_layout`,
    as the MoE and attention kernels read them) split `vocab` over more than one device."""
    mesh, rules = jax.sharding.get_abstract_mesh(), spmd.get_logical_axis_rules()
    if mesh.empty or not rules:
        return None
    spec = sharding_lib.logical_to_spec(("batch", "vocab"), shape_BV, mesh, rules)
    return (mesh, spec) if spec[1] is not None else None


def _sample_sharded(mesh, spec, logits_BV, uniform_B, rows, needs_filter):
    """`sample`'s rule with each device holding its [B, Vs] slice; `needs_filter` None: no filters."""
    row = PartitionSpec(spec[0])
    local = functools.partial(_sample_shard, spec[1], needs_filter is not None)
    needs_filter = jnp.asarray(False) if needs_filter is None else needs_filter
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(spec, row, (row, row, row), PartitionSpec()),
        out_specs=(row, row, row),
    )(logits_BV, uniform_B, rows, needs_filter)


def _sample_shard(axis, filters: bool, logits_BVs, uniform_B, rows, needs_filter):
    """One shard's part of `sample`; every [B] result is the same on all shards of `axis`."""
    temperature_B, top_p_B, top_k_B = rows
    first = jax.lax.axis_index(axis) * logits_BVs.shape[-1]  # global id of this shard's entry 0
    greedy_B = temperature_B <= 0
    unfiltered_BVs = logits_BVs / jnp.where(greedy_B, 1.0, temperature_B)[:, None]
    scaled_BVs = unfiltered_BVs
    if filters:
        scaled_BVs = _filter_shard(axis, scaled_BVs, top_k_B, top_p_B, needs_filter)
    sample_logps_BVs = _log_softmax_shard(axis, scaled_BVs)
    drawn_B = _inverse_cdf_shard(axis, jnp.exp(sample_logps_BVs), uniform_B, first)
    tokens_B = jnp.where(greedy_B, _argmax_shard(axis, logits_BVs, first), drawn_B).astype(jnp.int32)
    logp_B = _take_shard(axis, _log_softmax_shard(axis, unfiltered_BVs), tokens_B - first)
    sample_logp_B = jnp.where(greedy_B, 0.0, _take_shard(axis, sample_logps_BVs, tokens_B - first))
    return tokens_B, logp_B, sample_logp_B


def _log_softmax_shard(axis, x_BVs):
    """Exact log softmax over the whole row: global max and normaliser from B floats per shard."""
    max_B = jax.lax.pmax(jnp.max(x_BVs, axis=-1), axis)
    shifted_BVs = x_BVs - max_B[:, None]
    total_B = jax.lax.psum(jnp.sum(jnp.exp(shifted_BVs), axis=-1), axis)
    return shifted_BVs - jnp.log(total_B)[:, None]


def _argmax_shard(axis, x_BVs, first):
    """Global argmax, first index on ties (jnp.argmax's rule): the lowest index among the shards
    holding the row's max (a NaN counts as the max, as in jnp.argmax)."""
    max_B = jnp.max(x_BVs, axis=-1)
    best_B = jax.lax.pmax(max_B, axis)
    index_B = first + jnp.argmax(x_BVs, axis=-1).astype(jnp.int32)
    holds_B = (max_B == best_B) | jnp.isnan(max_B)
    return jax.lax.pmin(jnp.where(holds_B, index_B, jnp.iinfo(jnp.int32).max), axis)


def _inverse_cdf_shard(axis, probs_BVs, uniform_B, first):
    """`_inverse_cdf` over the whole row from each shard's mass: the shard whose mass range holds
    u * total finds the token in its local cumsum.

    The masses' running sum is built by sequential adds, the same adds a shard makes to offset
    its local cumsum, so shard s's offset cdf ends exactly at the range's end: the owner always
    finds a token inside its slice, and (as unsharded) never one of probability 0.
    """
    Vs = probs_BVs.shape[-1]
    cdf_BVs = jnp.cumsum(probs_BVs, axis=-1)
    masses_BS = jax.lax.all_gather(cdf_BVs[:, -1], axis, axis=1)
    S = masses_BS.shape[1]
    ends = [masses_BS[:, 0]]
    for s in range(1, S):
        ends.append(ends[-1] + masses_BS[:, s])
    ends_BS = jnp.stack(ends, axis=1)
    starts_BS = jnp.concatenate([jnp.zeros_like(ends_BS[:, :1]), ends_BS[:, :-1]], axis=1)
    threshold_B = uniform_B * ends_BS[:, -1]
    owner_B = jnp.minimum(jnp.sum(ends_BS <= threshold_B[:, None], axis=-1), S - 1)
    shard = jax.lax.axis_index(axis)
    start_B = jax.lax.dynamic_index_in_dim(starts_BS, shard, axis=1, keepdims=False)
    index_B = jnp.sum(start_B[:, None] + cdf_BVs <= threshold_B[:, None], axis=-1)
    index_B = first + jnp.minimum(index_B, Vs - 1).astype(jnp.int32)
    return jax.lax.psum(jnp.where(owner_B == shard, index_B, 0), axis)


def _take_shard(axis, values_BVs, local_B):
    """values[b, token_b] from the shard holding it (`local_B`: the token's index in this shard)."""
    Vs = values_BVs.shape[-1]
    inside_B = (local_B >= 0) & (local_B < Vs)
    value_B = _take(values_BVs, jnp.clip(local_B, 0, Vs - 1))
    return jax.lax.psum(jnp.where(inside_B, value_B, 0.0), axis)


def _filter_shard(axis, scaled_BVs, top_k_B, top_p_B, needs_filter):
    """`filter_logits` on a shard, its threshold computed on the GATHERED rows: an all-gather of
    [B, V] and a sort, run only when some row asks for a filter (`cond` on a flag replicated over
    the mesh, so every shard takes the same branch). Per-shard top-k candidates would not do:
    top-p with top_k 0 may keep nearly the whole vocabulary, and top_k has no static bound. Only
    programs built with filters (`EngineConfig.sampling_filters`) carry this branch; the default
    path gathers nothing."""

    def threshold(x_BVs):
        return _filter_threshold(jax.lax.all_gather(x_BVs, axis, axis=1, tiled=True), top_k_B, top_p_B)

    def keep_all(x_BVs):
        return jnp.full_like(x_BVs[:, 0], -jnp.inf)  # varying like the gathered branch's

    threshold_B = jax.lax.cond(needs_filter, threshold, keep_all, scaled_BVs)
    return jnp.where(scaled_BVs >= threshold_B[:, None], scaled_BVs, -jnp.inf)
