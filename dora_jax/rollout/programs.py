"""The rollout engine's jitted programs: pure steps over the decode state, jitted once per
(model, sizes, mesh, rules) with the slice's shardings (`engine_programs`).

Shape letters: B decode slots, C rows of a batched prefill, T prefill tokens (a bucket), R prefix
rows, S cache rows per slot, Q pages of a prefix, M page-table width, L layers, K kv heads,
D head_dim, V vocab.

Compiled programs are bounded: one `generate`; one `prefill` per bucket (powers of two from
`min_prefill_bucket` to `max_prefill_length`); one `insert` per row bucket (powers of two up to
the cache length; imports reuse them); one batched `prefill_insert` per (count, bucket) of
`EngineConfig.prefill_batches` (C prompts padded to one bucket, at most `max_prefill_length`
tokens together). The decode state is donated to `insert`, `prefill_insert` and `generate`.
The steps keep their leading underscore: a jitted program's name is its step's, and it names
the lowered module (`jit__generate_step`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from dora_jax.models import KVCache, ModelConfig, PagedKVCache, paged
from dora_jax.parallel import sharding as sharding_lib
from dora_jax.rollout import sampling
from dora_jax.rollout.engine_config import EngineConfig
from dora_jax.rollout.engine_state import DecodeState, Prefix, ResultTokens, pool_pack


def _prefill_step(
    graphdef,
    config: EngineConfig,
    mesh: Mesh,
    rules: sharding_lib.Rules,
    params,
    tokens_T,
    prior,
    start,
    true_length,
    key_data_2,
    temperature,
    top_p,
    top_k,
    sample_first,
    *,
    sampler,
):
    """Writes tokens_T at rows start.. of a fresh R-row cache (after `prior` rows) and samples."""
    model = nnx.merge(graphdef, params)
    T = tokens_T.shape[0]
    rows = (0 if prior is None else prior[0].shape[1]) + T
    cache = KVCache.zeros(model.config, batch=1, length=config.rows_bucket(rows))
    if prior is not None:
        cache = KVCache(
            *(
                jax.lax.dynamic_update_slice(c, p[:, None].astype(c.dtype), (0, 0, 0, 0, 0))
                for c, p in zip((cache.k_LBSKD, cache.v_LBSKD), prior)
            )
        )
    positions_1T = (start + jnp.arange(T, dtype=jnp.int32))[None]
    with sharding_lib.activation_layout(mesh, rules):  # the Pallas kernels (megablox) place their operands by it
        logits_1TV, cache = model(tokens_T[None], positions_1T, cache=cache)
    logits_1V = jax.lax.dynamic_index_in_dim(logits_1TV[0], true_length - 1, keepdims=True)
    end = start + true_length
    token_1, logp_1, sample_logp_1 = _pick(
        logits_1V,
        key_data_2[None],
        end[None],
        temperature[None],
        top_p[None],
        top_k[None],
        sampler,
        config.sampling_filters,
        mesh,
        rules,
    )
    pending = jax.lax.dynamic_index_in_dim(tokens_T, true_length - 1, keepdims=False)
    prefix = Prefix(
        k_LRKD=cache.k_LBSKD[:, 0],
        v_LRKD=cache.v_LBSKD[:, 0],
        length=jnp.where(sample_first, end, end - 1).astype(jnp.int32),
        token=jnp.where(sample_first, token_1[0], pending).astype(jnp.int32),
        logp=jnp.where(sample_first, logp_1[0], 0.0),
        key_data=key_data_2,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        generated=sample_first.astype(jnp.int32),
    )
    valid = sample_first.astype(jnp.int32)
    result = ResultTokens(
        data=jnp.stack([prefix.token, valid, prefix.generated])[None],
        log_prob=prefix.logp[None, None],
        sample_log_prob=jnp.where(sample_first, sample_logp_1, 0.0)[None],
    )
    return prefix, result


def _prefill_insert_step(
    graphdef,
    config: EngineConfig,
    mesh: Mesh,
    rules: sharding_lib.Rules,
    params,
    state: DecodeState,
    tokens_CT,
    length_C,
    slot_C,
    key_data_C2,
    temperature_C,
    top_p_C,
    top_k_C,
    sample_first_C,
    pages_CQ=None,
    *,
    sampler,
):
    """Prefills C prompts (row c: its first length_C[c] tokens, right-padded to T) in one forward,
    samples each one's first token and writes the rows into slots slot_C (a padding row's slot is
    B: its writes are dropped); paged, row c's T rows go into pages pages_CQ[c] (0 = scratch)."""
    model = nnx.merge(graphdef, params)
    C, T = tokens_CT.shape
    cache = KVCache.zeros(model.config, batch=C, length=T)
    positions_CT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (C, T))
    with sharding_lib.activation_layout(mesh, rules):  # the Pallas kernels (megablox) place their operands by it
        logits_CTV, cache = model(tokens_CT, positions_CT, cache=cache)
    last_C = length_C - 1
    logits_CV = jnp.take_along_axis(logits_CTV, last_C[:, None, None], axis=1)[:, 0]
    token_C, logp_C, sample_logp_C = _pick(
        logits_CV, key_data_C2, length_C, temperature_C, top_p_C, top_k_C, sampler, config.sampling_filters, mesh, rules
    )
    pending_C = jnp.take_along_axis(tokens_CT, last_C[:, None], axis=1)[:, 0]
    token_C = jnp.where(sample_first_C, token_C, pending_C).astype(jnp.int32)
    logp_C = jnp.where(sample_first_C, logp_C, 0.0)
    generated_C = sample_first_C.astype(jnp.int32)
    if pages_CQ is None:
        kv = tuple(
            c.at[:, slot_C, :T].set(new.astype(c.dtype), mode="drop")
            for c, new in zip((state.cache.k_LBSKD, state.cache.v_LBSKD), (cache.k_LBSKD, cache.v_LBSKD))
        )
        written = KVCache(*kv)
    else:  # every row's pages in one pass: the batch's rows as one sequence of C x Q pages
        flat = lambda x: x.reshape(x.shape[0], C * T, *x.shape[3:])  # noqa: E731
        written = paged.write_rows(state.cache, flat(cache.k_LBSKD), flat(cache.v_LBSKD), pages_CQ.reshape(-1))

    def put(vector, value):
        return vector.at[slot_C].set(value.astype(vector.dtype), mode="drop")

    state = DecodeState(
        cache=written,
        position_B=put(state.position_B, jnp.where(sample_first_C, length_C, length_C - 1)),
        token_B=put(state.token_B, token_C),
        generated_B=put(state.generated_B, generated_C),
        key_data_B2=put(state.key_data_B2, key_data_C2),
        temperature_B=put(state.temperature_B, temperature_C),
        top_p_B=put(state.top_p_B, top_p_C),
        top_k_B=put(state.top_k_B, top_k_C),
    )
    result = ResultTokens(
        data=jnp.stack([token_C, generated_C, generated_C], axis=1),
        log_prob=logp_C[:, None],
        sample_log_prob=jnp.where(sample_first_C, sample_logp_C, 0.0)[:, None],
    )
    return state, result


def _pick(logits_BV, key_data_B2, position_B, temperature_B, top_p_B, top_k_B, sampler, filters: bool, mesh, rules):
    """Next tokens and their log-probs: per-slot sampling, or the caller's `sampler`. The slice's
    mesh and rules are in context for `sampling.sample` only, which then samples the
    vocab-sharded logits shard by shard (nothing gathers [B, V])."""
    if sampler is None:
        with sharding_lib.activation_layout(mesh, rules):
            return sampling.sample(logits_BV, key_data_B2, position_B, temperature_B, top_p_B, top_k_B, filters=filters)
    tokens_B = jnp.asarray(sampler(logits_BV), jnp.int32).reshape(logits_BV.shape[0])
    logp_B = sampling.log_prob_of(logits_BV, tokens_B)
    return tokens_B, logp_B, logp_B


def _insert_step(prefix: Prefix, state: DecodeState, slot, pages_Q=None):
    """Puts `prefix` into `slot`: its rows into the dense cache, or into pages `pages_Q` (paged)."""

    def rows(cache_LBSKD, rows_LRKD):
        return jax.lax.dynamic_update_slice(
            cache_LBSKD, rows_LRKD[:, None].astype(cache_LBSKD.dtype), (0, slot, 0, 0, 0)
        )

    def put(vector, value):
        value = jnp.asarray(value, vector.dtype).reshape((1,) + vector.shape[1:])
        return jax.lax.dynamic_update_slice(vector, value, (slot,) + (0,) * (vector.ndim - 1))

    if pages_Q is None:
        cache = KVCache(rows(state.cache.k_LBSKD, prefix.k_LRKD), rows(state.cache.v_LBSKD, prefix.v_LRKD))
    else:
        cache = paged.write_rows(state.cache, prefix.k_LRKD, prefix.v_LRKD, pages_Q)
    return DecodeState(
        cache=cache,
        position_B=put(state.position_B, prefix.length),
        token_B=put(state.token_B, prefix.token),
        generated_B=put(state.generated_B, prefix.generated),
        key_data_B2=put(state.key_data_B2, prefix.key_data),
        temperature_B=put(state.temperature_B, prefix.temperature),
        top_p_B=put(state.top_p_B, prefix.top_p),
        top_k_B=put(state.top_k_B, prefix.top_k),
    )


def _generate_step(
    graphdef,
    config: EngineConfig,
    mesh: Mesh,
    rules: sharding_lib.Rules,
    params,
    state: DecodeState,
    table_BM=None,
    *,
    sampler,
):
    """One decode step; paged, `table_BM` is every slot's page table (a live-pages bucket wide)."""
    model = nnx.merge(graphdef, params)
    # the Pallas kernels (paged attention, megablox) place their operands by the rules in context
    with sharding_lib.activation_layout(mesh, rules):
        cache = state.cache if table_BM is None else PagedKVCache(state.cache, table_BM)
        logits_B1V, cache = model(state.token_B[:, None], state.position_B[:, None], cache=cache)
    next_B = state.position_B + 1
    tokens_B, logp_B, sample_logp_B = _pick(
        logits_B1V[:, 0],
        state.key_data_B2,
        next_B,
        state.temperature_B,
        state.top_p_B,
        state.top_k_B,
        sampler,
        config.sampling_filters,
        mesh,
        rules,
    )
    generated_B = state.generated_B + 1
    # Free slots keep stepping on garbage; clamping keeps their writes inside the cache.
    state = state.replace(
        cache=cache if table_BM is None else cache.kv,
        position_B=jnp.minimum(next_B, config.cache_length - 1),
        token_B=tokens_B,
        generated_B=generated_B,
    )
    data = jnp.stack([tokens_B, jnp.ones_like(tokens_B), generated_B], axis=1)
    return state, ResultTokens(data=data, log_prob=logp_B[:, None], sample_log_prob=sample_logp_B[:, None])


def _read_slot(head_dim: int, state: DecodeState, slot, pages_Q=None, *, rows: int):
    """The slot's first `rows` KV rows (from its pages `pages_Q` when paged, heads `head_dim` wide)
    and its vectors."""
    cut = lambda c: jax.lax.dynamic_slice_in_dim(jax.lax.dynamic_index_in_dim(c, slot, 1, False), 0, rows, 1)
    at = lambda v: jax.lax.dynamic_index_in_dim(v, slot, 0, False)
    if pages_Q is None:
        k_LRKD, v_LRKD = cut(state.cache.k_LBSKD), cut(state.cache.v_LBSKD)
    else:
        k_LRKD, v_LRKD = paged.read_rows(state.cache, pages_Q, head_dim)
    return (
        k_LRKD,
        v_LRKD,
        at(state.position_B),
        at(state.token_B),
        at(state.key_data_B2),
    )


def _zero_state(config: EngineConfig, model_config: ModelConfig, pack: int) -> DecodeState:
    """Every slot empty; a paged pool in the TPU kernel's combined layout, `pack` heads to a row,
    or (pack 0) split into keys and values."""
    B, cfg = config.num_slots, model_config
    if config.paged:
        shape = (cfg.num_layers, config.pool_pages, config.page_size, cfg.num_kv_heads, cfg.head_dim)
        cache = paged.pool_zeros(*shape, cfg.dtype, combined=pack > 0, pack=pack or None)
    else:
        cache = KVCache.zeros(model_config, batch=B, length=config.cache_length)
    return DecodeState(
        cache=cache,
        position_B=jnp.zeros((B,), jnp.int32),
        token_B=jnp.zeros((B,), jnp.int32),
        generated_B=jnp.zeros((B,), jnp.int32),
        key_data_B2=jnp.zeros((B, 2), jnp.uint32),
        temperature_B=jnp.zeros((B,), jnp.float32),
        top_p_B=jnp.ones((B,), jnp.float32),
        top_k_B=jnp.zeros((B,), jnp.int32),
    )


def decode_state_shapes(config: EngineConfig, model_config: ModelConfig, pack: int) -> DecodeState:
    """The init program's decode state as ShapeDtypeStructs (no memory, no shardings)."""
    return jax.eval_shape(lambda: _zero_state(config, model_config, pack))


@dataclasses.dataclass(frozen=True)
class Programs:
    """The jitted programs of one engine (compiled on first call per shape, once per process)."""

    init: Callable  # () -> DecodeState: every slot empty
    prefill: Callable  # (params, tokens_T, prior, start, true_length, key, sampling..., sample_first)
    insert: Callable  # (prefix, state, slot[, pages_Q]) -> state
    generate: Callable  # (params, state[, table_BM]) -> (state, ResultTokens)
    read_slot: Callable  # (state, slot[, pages_Q], rows=) -> (k, v, position, token, key data)
    prefill_insert: Callable  # (params, state, tokens_CT, ...[, pages_CQ]) -> (state, ResultTokens)


@functools.cache
def engine_programs(model_config, config, mesh, rules, graphdef, state_shardings, prefix_shardings) -> Programs:
    """The jitted programs of one (model, sizes, mesh, rules); engines with the same share them."""
    replicated = sharding_lib.replicated(mesh)
    result_shardings = ResultTokens(data=replicated, log_prob=replicated, sample_log_prob=replicated)
    return Programs(
        init=jax.jit(
            functools.partial(_zero_state, config, model_config, pool_pack(model_config, mesh, rules)),
            out_shardings=state_shardings,
        ),
        prefill=jax.jit(
            functools.partial(_prefill_step, graphdef, config, mesh, rules),
            static_argnames=("sampler",),
            out_shardings=(prefix_shardings, result_shardings),
        ),
        insert=jax.jit(_insert_step, donate_argnums=(1,), out_shardings=state_shardings),
        generate=jax.jit(
            functools.partial(_generate_step, graphdef, config, mesh, rules),
            static_argnames=("sampler",),
            donate_argnums=(1,),
            out_shardings=(state_shardings, result_shardings),
        ),
        # Replicated: every process of a multi-host slice can fetch the slot to host.
        read_slot=jax.jit(
            functools.partial(_read_slot, model_config.head_dim), static_argnames=("rows",), out_shardings=replicated
        ),
        prefill_insert=jax.jit(
            functools.partial(_prefill_insert_step, graphdef, config, mesh, rules),
            static_argnames=("sampler",),
            donate_argnums=(1,),
            out_shardings=(state_shardings, result_shardings),
        ),
    )
