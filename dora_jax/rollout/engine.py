"""The rollout engine: JetStream's Engine API over our decoder, on one rollout slice's mesh.

Shape letters: B decode slots, T prefill tokens (a bucket), R prefix rows, S cache rows per slot,
L layers, K kv heads, D head_dim, V vocab.

Same meanings as google/JetStream `engine_api.Engine` (jetstream itself is imported only by
`jetstream_adapter.py`): `prefill` computes a request's KV rows and samples its first token,
`insert` puts a prefix into a decode slot, `generate` feeds every slot's pending token and samples
the next one. Params are passed on every call, so the caller always knows which version produced
each token. The decode state is a pure pytree: per-slot KV cache, position, pending token, RNG key
and sampling params; `export_slot`/`import_slot` move one slot between engines with no prefill.
The generated tokens, log-probs and per-token versions are the caller's host-side record (the
worker reads every step's tokens anyway), so `export_slot` takes them and checks them against the
device state before it builds the `SlotState`.

Compiled programs are bounded: one `generate`; one `prefill` per bucket (powers of two from
`min_prefill_bucket` to `max_prefill_length`); one `insert` per row bucket (powers of two up to
the cache length; imports reuse them); one batched `prefill_insert` per (count, bucket) of
`EngineConfig.prefill_batches` (C prompts padded to one bucket, at most `max_prefill_length`
tokens together). The decode state is donated to `insert`, `prefill_insert` and `generate`.

Batched prefill (`prefill_insert`): several requests' prompts in one forward, each right-padded
to the batch's bucket (causal attention: padding changes nothing before it; a padding row's
writes are dropped), their first tokens sampled with their own keys and positions, and their KV
rows written into their slots (paged: every page of the batch in one scatter) in the same
program. A request's tokens and log-probs are those of `prefill` + `insert`: only the batch's
shapes differ (C letters the rows).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from dora_jax.core.records import Request, SamplingParams, SlotState
from dora_jax.models import (
    KV_CACHE_AXES,
    PAGED_KV_AXES,
    KVCache,
    ModelConfig,
    PagedKVCache,
    abstract_model,
    in_compute_dtype,
    load_hf,
    logical_axes,
    paged,
    served_abstract,
    split,
)
from dora_jax.parallel import sharding as sharding_lib
from dora_jax.rollout import sampling
from dora_jax.rollout.pages import OutOfPages, PagePool

_PREFIX_KV_AXES = ("layers", "length", "kv_heads", "head_dim")


class KVPoolTooSmall(ValueError):
    """The chip memory left after the weights holds too few KV pages for one request."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static engine sizes; every field is a compile-time shape."""

    num_slots: int = 8  # B: concurrent decodes (JetStream's max_concurrent_decodes)
    cache_length: int = 256  # S: prompt + response tokens one slot can hold
    max_prefill_length: int = 128  # largest prefill bucket; a power of two
    min_prefill_bucket: int = 16  # smallest prefill bucket; a power of two
    default_sampling: SamplingParams = SamplingParams(temperature=0.0)  # when a call passes none
    # Top-k / top-p filtering compiled into prefill and generate. Its sort and cumsum over the
    # vocabulary cost the TPU compiler ~20 s per program (Qwen's 152K vocabulary); off, requests
    # asking for a filter are refused. RolloutSpec.engine_config turns it on when the run's
    # sampling filters.
    sampling_filters: bool = True
    # Paged KV cache (dora_jax.models.paged): rows per page, a power of two up to
    # min_prefill_bucket dividing cache_length; 0 = the dense cache (every slot holds
    # cache_length rows whatever its length).
    page_size: int = 0
    # Pages in the pool, the scratch page included. Fewer pages than every slot at cache_length
    # hold more slots at the same memory: a request is admitted when its pages are free, and the
    # youngest is preempted when the pool runs dry. 0 = sized by the engine: `kv_memory_fraction`
    # of the chip memory left after the served weights, capped at every slot full (which is also
    # the size where the chip's memory is unknown, as on CPU).
    num_pages: int = 0
    kv_memory_fraction: float = 0.8
    # Most prompts one batched prefill program takes (a power of two; 1 = one prompt per prefill,
    # as JetStream's API). A batch's prompts are padded to one bucket and take at most
    # max_prefill_length tokens together (count x bucket), as the largest single prefill does.
    max_prefill_batch: int = 32

    def __post_init__(self):
        for name in ("max_prefill_length", "min_prefill_bucket", "max_prefill_batch"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"engine.{name}={value}; expected a power of two")
        if self.min_prefill_bucket > self.max_prefill_length:
            raise ValueError(
                f"engine.min_prefill_bucket={self.min_prefill_bucket} > max_prefill_length={self.max_prefill_length}"
            )
        if self.max_prefill_length > self.cache_length:
            raise ValueError(f"engine.max_prefill_length={self.max_prefill_length} > cache_length={self.cache_length}")
        if self.num_slots < 1:
            raise ValueError(f"engine.num_slots={self.num_slots}; expected >= 1")
        if self.page_size:
            ps = self.page_size
            if ps < 1 or ps & (ps - 1) or ps > self.min_prefill_bucket or self.cache_length % ps:
                raise ValueError(
                    f"engine.page_size={ps}; expected 0 (dense) or a power of two <= min_prefill_bucket="
                    f"{self.min_prefill_bucket} dividing cache_length={self.cache_length}"
                )
            if self.num_pages and self.num_pages - 1 < self.pages_per_slot:
                raise ValueError(
                    f"engine.num_pages={self.num_pages} gives {self.num_pages - 1} pages of page_size={ps} rows "
                    f"(page 0 is scratch); one request at cache_length={self.cache_length} needs "
                    f"{self.pages_per_slot}: expected 0 (every slot full) or >= {self.pages_per_slot + 1}"
                )
        elif self.num_pages:
            raise ValueError(f"engine.num_pages={self.num_pages} without engine.page_size; expected a page_size")
        if not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(f"engine.kv_memory_fraction={self.kv_memory_fraction}; expected 0 < fraction <= 1")

    @property
    def paged(self) -> bool:
        return self.page_size > 0

    @property
    def pages_per_slot(self) -> int:
        """M: the page-table width (cache_length rows)."""
        return self.cache_length // self.page_size if self.paged else 0

    @property
    def pool_pages(self) -> int:
        """Pages in the pool, the scratch page included."""
        if not self.paged:
            return 0
        return self.num_pages or self.num_slots * self.pages_per_slot + 1

    @property
    def live_page_buckets(self) -> tuple[int, ...]:
        """Page-table widths `generate` is compiled for: powers of two up to M, and M (the
        reference attention's work follows the longest live slot, not cache_length)."""
        sizes, size = [], 1
        while size < self.pages_per_slot:
            sizes.append(size)
            size *= 2
        return tuple(sizes) + (self.pages_per_slot,)

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        sizes, size = [], self.min_prefill_bucket
        while size <= self.max_prefill_length:
            sizes.append(size)
            size *= 2
        return tuple(sizes)

    def prefill_chunks(self, length: int) -> tuple[int, ...]:
        """How `prefill` takes `length` tokens: chunks of `max_prefill_length`, each appended to the
        last one's prefix (`existing_prefix`); the final chunk is padded to its bucket, and that must
        fit the cache. ValueError naming the numbers if it does not."""
        if length < 1:
            raise ValueError(f"{length} tokens to prefill; expected >= 1")
        whole, last = divmod(length, self.max_prefill_length)
        chunks = (self.max_prefill_length,) * whole + ((last,) if last else ())
        start = length - chunks[-1]
        bucket = next(b for b in self.prefill_buckets if b >= chunks[-1])
        if start + bucket > self.cache_length:
            raise ValueError(
                f"{length} tokens prefill in chunks of max_prefill_length={self.max_prefill_length}; "
                f"the last ({chunks[-1]} tokens, padded to {bucket}) after {start} overflows "
                f"cache_length={self.cache_length}"
            )
        return chunks

    @property
    def prefill_batches(self) -> tuple[tuple[int, int], ...]:
        """(count C, bucket T) of every batched prefill program: C a power of two from 2 to
        `max_prefill_batch` (and to the slots rounded up to a power of two), C x T <=
        max_prefill_length."""
        widest = min(self.max_prefill_batch, 1 << (self.num_slots - 1).bit_length())
        out = []
        for bucket in self.prefill_buckets:
            count = 2
            while count <= widest and count * bucket <= self.max_prefill_length:
                out.append((count, bucket))
                count *= 2
        return tuple(out)

    def batchable(self, length: int) -> bool:
        """Whether a prefill of `length` tokens can share a batched program with others."""
        return length <= self.max_prefill_length and (2, self.prefill_bucket(length)) in self.prefill_batches

    def prefill_bucket(self, length: int) -> int:
        """The bucket a prefill of `length` tokens (<= max_prefill_length) is padded to."""
        return next(b for b in self.prefill_buckets if b >= length)

    def rows_bucket(self, rows: int) -> int:
        """Rows of a prefix holding `rows` valid rows: a power of two, capped at the cache length."""
        size = self.min_prefill_bucket
        while size < rows:
            size *= 2
        return min(size, self.cache_length)


@dataclasses.dataclass(frozen=True)
class PrefillRequest:
    """One request of a batched prefill (`RolloutEngine.prefill_insert`): `tokens` (one chunk, at
    most max_prefill_length) prefilled into `slot`; the other fields as `prefill`'s and `insert`'s."""

    slot: int
    tokens: Sequence[int]  # prompt ids (+ a response prefix when re-prefilled)
    sampling: SamplingParams | None = None  # None: EngineConfig.default_sampling
    rng: Any = None  # the request's base key (typed key or uint32[2]); None: from sampling.seed
    sample_first: bool = True  # False: the last token stays pending (resuming a response)
    shared_from: int | None = None  # paged: take this slot's whole pages below the prompt's end


@flax.struct.dataclass
class Prefix:
    """One request after prefill: KV rows 0..length-1 valid, `token` pending (not yet fed)."""

    k_LRKD: jax.Array
    v_LRKD: jax.Array
    length: jax.Array  # int32: valid rows = position where `token` will be written
    token: jax.Array  # int32
    logp: jax.Array  # float32: log-prob of `token` at the temperature, unfiltered (0 when it was not sampled)
    key_data: jax.Array  # uint32[2]: the slot's base sampling key
    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    generated: jax.Array  # int32: tokens this engine has sampled for the request


@flax.struct.dataclass
class DecodeState:
    """Every slot's state; the only thing `generate` transforms."""

    cache: KVCache | tuple  # k_LBSKD / v_LBSKD, or the paged pool (one [P, N, C, D] array per layer)
    position_B: jax.Array  # row where each slot's pending token goes
    token_B: jax.Array  # pending token (the last sampled one)
    generated_B: jax.Array
    key_data_B2: jax.Array
    temperature_B: jax.Array
    top_p_B: jax.Array
    top_k_B: jax.Array


@flax.struct.dataclass
class ResultTokens:
    """JetStream's ResultTokens layout (`data` = [token | valid | length] per slot) plus log-probs."""

    data: jax.Array  # [B, 3] int32
    log_prob: jax.Array  # [B, 1] log-prob of each token at its temperature, unfiltered (sampling.sample)
    sample_log_prob: jax.Array  # [B, 1] log-prob under the sampling distribution
    tokens_idx: tuple[int, int] = flax.struct.field(pytree_node=False, default=(0, 1))
    valid_idx: tuple[int, int] = flax.struct.field(pytree_node=False, default=(1, 2))
    length_idx: tuple[int, int] = flax.struct.field(pytree_node=False, default=(2, 3))
    samples_per_slot: int = flax.struct.field(pytree_node=False, default=1)

    def copy_to_host_async(self) -> None:
        for array in (self.data, self.log_prob, self.sample_log_prob):
            if isinstance(array, jax.Array):
                array.copy_to_host_async()

    def convert_to_numpy(self) -> ResultTokens:
        return jax.tree.map(np.asarray, jax.device_get(self))


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


@functools.cache
def _programs(model_config, config, mesh, rules, graphdef, state_shardings, prefix_shardings):
    """The jitted programs of one (model, sizes, mesh, rules): (init, prefill, insert, generate, read,
    prefill_insert)."""
    replicated = sharding_lib.replicated(mesh)
    result_shardings = ResultTokens(data=replicated, log_prob=replicated, sample_log_prob=replicated)
    return (
        jax.jit(
            functools.partial(_zero_state, config, model_config, _pool_pack(model_config, mesh, rules)),
            out_shardings=state_shardings,
        ),
        jax.jit(
            functools.partial(_prefill_step, graphdef, config, mesh, rules),
            static_argnames=("sampler",),
            out_shardings=(prefix_shardings, result_shardings),
        ),
        jax.jit(_insert_step, donate_argnums=(1,), out_shardings=state_shardings),
        jax.jit(
            functools.partial(_generate_step, graphdef, config, mesh, rules),
            static_argnames=("sampler",),
            donate_argnums=(1,),
            out_shardings=(state_shardings, result_shardings),
        ),
        # Replicated: every process of a multi-host slice can fetch the slot to host.
        jax.jit(
            functools.partial(_read_slot, model_config.head_dim), static_argnames=("rows",), out_shardings=replicated
        ),
        jax.jit(
            functools.partial(_prefill_insert_step, graphdef, config, mesh, rules),
            static_argnames=("sampler",),
            donate_argnums=(1,),
            out_shardings=(state_shardings, result_shardings),
        ),
    )


def _batch_shapes(config: EngineConfig, count: int, bucket: int) -> list[jax.ShapeDtypeStruct]:
    """The host arguments of a batched prefill of `count` rows of `bucket` tokens, as shapes."""
    i32, C = jnp.int32, count
    shapes = [((C, bucket), i32), ((C,), i32), ((C,), i32), ((C, 2), jnp.uint32)]
    shapes += [((C,), jnp.float32), ((C,), jnp.float32), ((C,), i32), ((C,), jnp.bool_)]
    if config.paged:
        shapes.append(((C, bucket // config.page_size), i32))
    return [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]


def _power_of_two(n: int) -> int:
    """The smallest power of two >= n."""
    return 1 << (n - 1).bit_length()


def _seconds(fn: Callable) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def _empty_prefix(model_config: ModelConfig, rows: int) -> Prefix:
    kv = np.zeros(
        (model_config.num_layers, rows, model_config.num_kv_heads, model_config.head_dim), jnp.dtype(model_config.dtype)
    )
    return Prefix(
        kv,
        kv,
        np.int32(0),
        np.int32(0),
        np.float32(0),
        np.zeros((2,), np.uint32),
        np.float32(0),
        np.float32(1),
        np.int32(0),
        np.int32(0),
    )


def _combined(mesh: Mesh) -> bool:
    """A paged pool in the TPU kernel's combined layout on TPU, split into keys and values elsewhere."""
    return mesh.devices.flat[0].platform == "tpu"


def _pool_pack(model_config: ModelConfig, mesh: Mesh, rules) -> int:
    """0: a split pool (not TPU); else kv heads per row of the combined pool (`paged.lane_pack`,
    each device's share of the heads whole)."""
    if not _combined(mesh):
        return 0
    K = model_config.num_kv_heads
    spec = sharding_lib.logical_to_spec(("kv_heads",), (K,), mesh, rules)[0]
    axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
    return paged.lane_pack(K, model_config.head_dim, int(np.prod([mesh.shape[a] for a in axes], dtype=int)))


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


class RolloutEngine:
    """JetStream-style engine for one rollout slice: `mesh` with `rules` (tensor parallel weights,
    KV heads over `tensor`, slots over `data`)."""

    def __init__(
        self,
        model_config: ModelConfig,
        config: EngineConfig,
        mesh: Mesh,
        rules: sharding_lib.Rules = sharding_lib.ROLLOUT_RULES,
        tokenizer: Any = None,
        hbm_bytes: int | None = None,
    ):
        """`hbm_bytes`: memory per chip that sizes a paged pool whose `num_pages` is 0 (default: the
        device's own `bytes_limit`; ahead-of-time compiles pass the target chip's)."""
        # Params are served in the compute dtype (every block casts them so before use: no number
        # changes; bf16 serving holds half the bytes of fp32 master weights).
        model_config = model_config.replace(param_dtype=model_config.dtype)
        self.model_config, self._mesh, self._rules = model_config, mesh, rules
        self._pack = _pool_pack(model_config, mesh, rules)  # 0: a split pool; else kv heads per row
        self.tokenizer = tokenizer
        abstract = abstract_model(model_config)
        self._graphdef, abstract_params = split(abstract)
        self._param_shardings = sharding_lib.tree_shardings(logical_axes(abstract), abstract_params, mesh, rules)
        self.config = config = self._sized(config, hbm_bytes)
        self._param_structure = jax.tree.structure(abstract_params)
        self._param_shapes = [tuple(x.shape) for x in jax.tree.leaves(abstract_params)]
        self._state_shardings = self._shardings_for(
            jax.eval_shape(lambda: _zero_state(config, model_config, self._pack))
        )
        self._prefix_shardings = self._prefix_sharding_tree()
        # Engines with the same model, sizes and mesh share compiled programs (a worker per
        # time-shared slice, a re-created engine) instead of compiling them again.
        (
            self._init_jit,
            self._prefill_jit,
            self._insert_jit,
            self._generate_jit,
            self._read_jit,
            self._prefill_insert_jit,
        ) = _programs(model_config, config, mesh, rules, self._graphdef, self._state_shardings, self._prefix_shardings)
        # Paged: which pages each slot holds and where it writes next, kept here on the host for the
        # one live decode state (init_decode_state starts them over), and the page-table widths
        # generate runs at (one: the TPU kernel reads only live pages whatever the width).
        self._live_widths = (config.pages_per_slot,) if self.paged_kernel else config.live_page_buckets
        self._reset_pages()
        # Seconds one prefill of each bucket took, measured by `warmup` (the migration rule's cost).
        self.prefill_seconds: dict[int, float] = {}

    def kv_bytes_per_page(self) -> int:
        """Bytes one KV page takes on each chip of the slice (the pool's kv heads split over devices)."""
        cfg, config = self.model_config, self.config
        shape = paged.combined_layer_shape(1, config.page_size, cfg.num_kv_heads, cfg.head_dim, self._pack or 1)
        shard = self._spec(PAGED_KV_AXES, shape).shard_shape(shape)
        return cfg.num_layers * int(np.prod(shard)) * jnp.dtype(cfg.dtype).itemsize

    def served_bytes_per_chip(self) -> int:
        """Bytes of one served version's params on each chip of the slice."""
        total = 0
        for leaf, sharding in zip(
            jax.tree.leaves(self.served_abstract_params()), jax.tree.leaves(self._param_shardings), strict=True
        ):
            total += int(np.prod(sharding.shard_shape(leaf.shape))) * jnp.dtype(leaf.dtype).itemsize
        return total

    def _sized(self, config: EngineConfig, hbm_bytes: int | None) -> EngineConfig:
        """`config` with a paged pool of `num_pages` 0 sized from the chip memory left after the weights."""
        if not config.paged or config.num_pages:
            return config
        self.config = config
        full = config.num_slots * config.pages_per_slot + 1
        if hbm_bytes is None:
            hbm_bytes = (self._mesh.local_devices[0].memory_stats() or {}).get("bytes_limit")
        if not hbm_bytes:
            return dataclasses.replace(config, num_pages=full)
        left = hbm_bytes - self.served_bytes_per_chip()
        pages = int(left * config.kv_memory_fraction) // self.kv_bytes_per_page() + 1
        if pages - 1 < config.pages_per_slot:
            raise KVPoolTooSmall(
                f"engine.kv_memory_fraction={config.kv_memory_fraction} of the {left / 2**30:.2f} GiB per chip left "
                f"after the weights holds {pages - 1} KV pages of page_size={config.page_size}; one request at "
                f"cache_length={config.cache_length} needs {config.pages_per_slot} (more chips per rollout slice, "
                "a larger fraction, or a shorter cache_length)"
            )
        return dataclasses.replace(config, num_pages=min(pages, full))

    @property
    def paged_kernel(self) -> bool:
        """Whether a paged decode step attends with the ragged paged attention TPU kernel."""
        if not self.config.paged:
            return False
        cfg, platform = self.model_config, self._mesh.devices.flat[0].platform
        with sharding_lib.activation_layout(self._mesh, self._rules):
            width = self._pack * cfg.head_dim
            return self._pack > 0 and paged.uses_kernel(cfg.attention, cfg.dtype, width, backend=platform)

    def _reset_pages(self) -> None:
        cfg = self.config
        self._pages = PagePool(cfg.pool_pages, cfg.page_size, cfg.num_slots, cfg.pages_per_slot) if cfg.paged else None
        self._position = np.zeros((cfg.num_slots,), np.int64)  # the row each active slot writes next
        self._active = np.zeros((cfg.num_slots,), bool)
        self._table: tuple[tuple[int, int], Any] | None = None  # ((revision, width), device table)

    # ------------------------------------------------------------------ shardings
    def _spec(self, names: Sequence[str | None], shape) -> NamedSharding:
        return sharding_lib.logical_sharding(tuple(names), tuple(shape), self._mesh, self._rules)

    def _shardings_for(self, state: DecodeState) -> DecodeState:
        def vector(x):
            return self._spec(("batch",) + (None,) * (x.ndim - 1), x.shape)

        if self.config.paged:
            cache = tuple(jax.tree.map(lambda x: self._spec(PAGED_KV_AXES, x.shape), layer) for layer in state.cache)
        else:
            cache = KVCache(*(self._spec(KV_CACHE_AXES, c.shape) for c in (state.cache.k_LBSKD, state.cache.v_LBSKD)))
        return jax.tree.map(vector, state.replace(cache=None)).replace(cache=cache)

    def _prefix_sharding_tree(self) -> Prefix:
        cfg = self.model_config
        kv = self._spec(
            _PREFIX_KV_AXES, (cfg.num_layers, self.config.min_prefill_bucket, cfg.num_kv_heads, cfg.head_dim)
        )
        rep = sharding_lib.replicated(self._mesh)
        return Prefix(kv, kv, rep, rep, rep, rep, rep, rep, rep, rep)

    # ------------------------------------------------------------------ JetStream Engine API
    @property
    def max_concurrent_decodes(self) -> int:
        return self.config.num_slots

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self.config.max_prefill_length

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    @property
    def colocated_cpus(self) -> None:
        return None

    def get_prefix_destination_sharding(self) -> Prefix:
        """Shardings a Prefix must have to be inserted here (a pytree like Prefix)."""
        return self._prefix_shardings

    def get_tokenizer(self) -> Any:
        """The tokenizer given at construction (HFTokenizer / CharTokenizer) or None."""
        return self.tokenizer

    def free_resource(self, slot: int) -> None:
        """Paged: the slot's pages go back to the pool (its later garbage steps write to scratch).
        Dense: nothing to free, the next insert overwrites the slot."""
        self._check_slot(slot)
        if self._pages is not None:
            self._pages.release(slot)
            self._active[slot] = False

    # ------------------------------------------------------------------ pages
    @property
    def pages(self) -> PagePool | None:
        """The host's page pool of the live decode state (None: dense cache)."""
        return self._pages

    def _growing(self, skip: int = -1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(slots, their rows after the next step, pages each lacks for them) of the occupied slots
        but `skip` (numpy over the slots: this runs before every decode step)."""
        active = np.flatnonzero(self._active & (np.arange(self.config.num_slots) != skip))
        rows = np.minimum(self._position[active] + 1, self.config.cache_length)
        lacking = np.maximum(0, -(-rows // self.config.page_size) - self._pages.held[active])
        return active, rows, lacking

    def _decoding_shortfall(self, skip: int = -1) -> int:
        return int(self._growing(skip)[2].sum())

    def page_shortfall(self) -> int:
        """Pages the next `generate` needs beyond those free (> 0: it would raise OutOfPages; the
        caller preempts first). 0 for a dense cache."""
        if self._pages is None:
            return 0
        return max(0, self._decoding_shortfall() - self._pages.free_pages)

    def admit_shortfall(self, slot: int, tokens: int, *, reserved: int = 0) -> int:
        """Pages short of admitting `tokens` prefilled tokens into `slot` now while keeping the
        pages the other slots' next step needs and `reserved` pages promised to requests admitted
        with it (0: admit). 0 for a dense cache."""
        if self._pages is None:
            return 0
        need = self.pages_for_prefill(tokens) + self._decoding_shortfall(skip=slot) + reserved
        return max(0, need - self._pages.free_pages)

    def pages_for_prefill(self, tokens: int) -> int:
        """Pages a slot takes for `tokens` prefilled tokens and its pending token's row (0: dense)."""
        return 0 if self._pages is None else self._pages.pages_for(min(tokens + 1, self.config.cache_length))

    def _host_length(self, prefix: Prefix) -> int:
        known = getattr(prefix, "_host_length", None)
        if known is not None:
            return known
        length = prefix.length  # a Prefix built elsewhere: read this host's copy (one sync)
        return int(length.addressable_data(0) if isinstance(length, jax.Array) else length)

    def _page_row(self, slot: int, width: int) -> np.ndarray:
        """The slot's first `width` page-table entries (0 = scratch past what it holds)."""
        row = np.zeros((width,), np.int32)
        held = self._pages.pages(slot)[:width]
        row[: len(held)] = held
        return row

    def _device_table(self):
        pool = self._pages
        live = max(1, max((int(pool.held[s]) for s in np.flatnonzero(self._active)), default=1))
        width = next(w for w in self._live_widths if w >= live)
        key = (pool.revision, width)
        if self._table is None or self._table[0] != key:
            self._table = (key, self._put_table(pool.table[:, :width]))
        return self._table[1]

    def _put_table(self, table_BM: np.ndarray):
        # A copy: a CPU device_put may alias the host buffer, and the pool's table changes in place.
        return jax.device_put(np.array(table_BM, np.int32, copy=True), sharding_lib.replicated(self._mesh))

    def load_params(self, params: Any = None, *, hf_path: str | None = None) -> Any:
        """Params placed with this slice's shardings: `params` (a pure dict like `models.split`'s)
        moved here, or a HF checkpoint read shard-by-shard from `hf_path`."""
        if (params is None) == (hf_path is None):
            raise ValueError("load_params needs exactly one of params= or hf_path=")
        if hf_path is not None:
            model = load_hf(
                hf_path,
                self.model_config.dtype,
                param_dtype=self.model_config.param_dtype,
                mesh=self._mesh,
                rules=self._rules,
            )
            params = split(model)[1]
        if jax.tree.structure(params) != self._param_structure:
            raise ValueError("params tree does not match this engine's model config (different architecture?)")
        shapes = [tuple(x.shape) for x in jax.tree.leaves(params)]
        if shapes != self._param_shapes:
            bad = next(i for i, (a, b) in enumerate(zip(shapes, self._param_shapes)) if a != b)
            raise ValueError(f"params leaf {bad} has shape {shapes[bad]}, expected {self._param_shapes[bad]}")
        return in_compute_dtype(jax.device_put(params, self._param_shardings), self.model_config.dtype)

    def init_decode_state(self) -> DecodeState:
        """All slots empty (zeros), born with the slice's shardings; paged, every page free again
        (an engine keeps the page pool of one live decode state: the newest)."""
        self._reset_pages()
        return self._init_jit()

    def prefill(
        self,
        *,
        params,
        existing_prefix: Prefix | None = None,
        padded_tokens,
        true_length: int,
        sampler: Callable | None = None,
        rng: Any = None,
        sampling: SamplingParams | None = None,
        sample_first: bool = True,
    ) -> tuple[Prefix, ResultTokens]:
        """KV rows for `padded_tokens[:true_length]` (appended after `existing_prefix` if given) and
        the first sampled token with its log-prob.

        `rng`: the request's base key (typed key or raw uint32[2]); default: from `sampling.seed`.
        `sample_first=False` samples nothing: the last true token stays pending, so decoding resumes
        a response whose last token was already sampled (re-dispatch with a response prefix).
        `sampler(logits_BV) -> tokens_B` replaces per-slot sampling (one compile per sampler).
        """
        tokens = np.asarray(padded_tokens).reshape(-1)
        true_length = int(true_length)
        if not 1 <= true_length <= tokens.shape[0]:
            raise ValueError(f"true_length={true_length}; expected 1..{tokens.shape[0]} (len(padded_tokens))")
        if true_length > self.config.max_prefill_length:
            raise ValueError(f"true_length={true_length} exceeds max_prefill_length={self.config.max_prefill_length}")
        self._check_ids(tokens[:true_length], "padded_tokens")
        sampling_params = self._check_sampling(sampling or self.config.default_sampling)
        bucket = next(b for b in self.config.prefill_buckets if b >= true_length)
        padded = np.zeros((bucket,), np.int32)
        padded[:true_length] = tokens[:true_length]
        prior, start = None, 0
        if existing_prefix is not None:
            length = existing_prefix.length  # replicated: read this host's copy (a slice may span hosts)
            start = int(length.addressable_data(0) if isinstance(length, jax.Array) else length)
            prior = (existing_prefix.k_LRKD, existing_prefix.v_LRKD)
            if start + bucket > self.config.cache_length:  # the prefix's rows past `start` are padding
                raise ValueError(
                    f"existing_prefix ({start} tokens) + {bucket} (the bucket of {true_length} tokens) "
                    f"exceed cache_length={self.config.cache_length}"
                )
        prefix, result = self._prefill_jit(
            params,
            padded,
            prior,
            np.int32(start),
            np.int32(true_length),
            self._key_data(rng, sampling_params),
            np.float32(sampling_params.temperature),
            np.float32(sampling_params.top_p),
            np.int32(sampling_params.top_k),
            np.bool_(sample_first),
            sampler=sampler,
        )
        # The length as the host knows it, so that a paged insert need not wait for the prefill.
        object.__setattr__(prefix, "_host_length", start + true_length - (0 if sample_first else 1))
        return prefix, result

    def shared_prefix(self, decode_state: DecodeState, source: int, tokens: int) -> Prefix | None:
        """Paged: the first rows of a prompt of `tokens` tokens that slot `source` holds, as a Prefix
        for `prefill(existing_prefix=...)` of the rest (less than a page) and then
        `insert(..., shared_from=source)`: the new slot takes `source`'s whole pages below the prompt's
        end by reference instead of prefilling and storing the prompt again (a GRPO group's G samples).
        None when there is no whole page to share, or for a dense cache."""
        if self._pages is None or not self._active[source] or tokens > self.config.max_prefill_length:
            return None  # (a prompt past one prefill chunk is prefilled whole: its buckets are warm)
        N = self.config.page_size
        shared = min((tokens - 1) // N, int(self._pages.held[source]))
        if shared < 1 or shared * N + self.config.min_prefill_bucket > self.config.cache_length:
            return None
        rows = self.config.rows_bucket(shared * N)
        k, v, *_ = self._read_jit(decode_state, np.int32(source), self._page_row(source, rows // N), rows=rows)
        k, v = jax.device_put((k, v), (self._prefix_shardings.k_LRKD, self._prefix_shardings.v_LRKD))
        prefix = _empty_prefix(self.model_config, 1).replace(k_LRKD=k, v_LRKD=v, length=np.int32(shared * N))
        object.__setattr__(prefix, "_host_length", shared * N)
        return prefix

    def insert(
        self, prefix: Prefix, decode_state: DecodeState, slot: int, *, shared_from: int | None = None
    ) -> DecodeState:
        """Puts `prefix` into `slot` (its previous occupant is overwritten); donates decode_state.
        Paged: the previous occupant's pages are freed and the slot takes pages for the prefix's
        rows and its pending token's (OutOfPages, nothing changed, when the pool lacks them:
        `admit_shortfall` says so beforehand)."""
        self._check_slot(slot)
        rows = prefix.k_LRKD.shape[1]
        if rows > self.config.cache_length:
            raise ValueError(f"prefix has {rows} rows, more than cache_length={self.config.cache_length}")
        if self._pages is None:
            return self._insert_jit(prefix, decode_state, np.int32(slot))
        shared = self._claim(slot, self._host_length(prefix), shared_from)
        return self._insert_jit(prefix, decode_state, np.int32(slot), self._write_row(slot, rows, shared))

    def _shared_pages(self, slot: int, length: int, shared_from: int | None) -> int:
        """Whole pages below a prompt of `length` rows that `slot` would take from `shared_from`."""
        if shared_from is None:
            return 0
        if shared_from == slot or not self._active[shared_from]:
            raise ValueError(f"shared_from={shared_from}: expected another occupied slot than {slot}")
        return min((length - 1) // self.config.page_size, int(self._pages.held[shared_from]))

    def _claim(self, slot: int, length: int, shared_from: int | None) -> int:
        """Paged host side of an insert: `slot` lets go of its pages and takes pages for `length`
        rows and its pending token's, sharing `shared_from`'s whole pages below them (OutOfPages,
        nothing changed, when the pool lacks them). Returns the pages shared."""
        rows_held = min(length + 1, self.config.cache_length)  # its rows and its pending token's
        shared = self._shared_pages(slot, length, shared_from)
        need = self._pages.pages_for(rows_held) - shared
        if need > self._pages.free_pages + self._pages.releasable(slot):
            raise OutOfPages(
                f"slot {slot}: a prefix of {length} tokens needs {need} pages; {self._pages.free_pages} are free"
            )
        self._pages.release(slot)
        if shared:
            self._pages.share(slot, shared_from, shared)
        self._pages.grow(slot, rows_held)
        self._position[slot], self._active[slot] = length, True
        return shared

    def _write_row(self, slot: int, rows: int, shared: int) -> np.ndarray:
        """The pages `rows` rows written for `slot` go to; its shared pages are never written: their
        rows go to scratch."""
        pages_Q = self._page_row(slot, rows // self.config.page_size)
        pages_Q[:shared] = paged.SCRATCH_PAGE
        return pages_Q

    # ------------------------------------------------------------------ batched prefill
    def prefill_insert(
        self, params, decode_state: DecodeState, requests: Sequence[PrefillRequest], sampler: Callable | None = None
    ) -> tuple[DecodeState, list[tuple[ResultTokens, tuple[int, ...]]]]:
        """Prefills `requests` and puts each into its slot, as `prefill` + `insert` of each in turn
        would (the same tokens and log-probs), with several prompts to a program (donates
        decode_state). Returns the new state and, per program, its first tokens with the index in
        `requests` of each row (a row past them is padding). Paged, OutOfPages with nothing changed
        when the pool lacks the pages of all of them; a request may share the pages of an occupied
        slot or of an earlier request's."""
        rows = [self._checked_request(r) for r in requests]
        slots = [r.slot for r in requests]
        if len(set(slots)) != len(slots):
            raise ValueError(f"prefill_insert slots {slots}: expected each slot once")
        shared = self._claim_all(requests, rows) if self._pages is not None else [0] * len(requests)
        out = []
        for count, bucket, members in self._batch_plan([len(tokens) for tokens, *_ in rows]):
            if count == 1:  # a bucket no batched program takes: one prefill and its insert
                (i,) = members
                tokens, sampling_params, key_data = rows[i]
                prefix, result = self.prefill(
                    params=params,
                    padded_tokens=tokens,
                    true_length=len(tokens),
                    sampler=sampler,
                    rng=key_data,
                    sampling=sampling_params,
                    sample_first=requests[i].sample_first,
                )
                pages_Q = None if self._pages is None else self._write_row(slots[i], bucket, shared[i])
                args = () if pages_Q is None else (pages_Q,)
                decode_state = self._insert_jit(prefix, decode_state, np.int32(slots[i]), *args)
            else:
                decode_state, result = self._dispatch_batch(
                    params, decode_state, [(requests[i], rows[i], shared[i]) for i in members], count, bucket, sampler
                )
            out.append((result, tuple(members)))
        return decode_state, out

    def _checked_request(self, request: PrefillRequest) -> tuple[np.ndarray, SamplingParams, np.ndarray]:
        """(tokens, sampling params, key data) of a batched prefill's request, checked."""
        self._check_slot(request.slot)
        tokens = np.asarray(request.tokens, np.int32).reshape(-1)
        if not 1 <= tokens.shape[0] <= self.config.max_prefill_length:
            raise ValueError(
                f"a batched prefill of {tokens.shape[0]} tokens; expected 1..max_prefill_length="
                f"{self.config.max_prefill_length} (longer prompts prefill in chunks: `prefill`)"
            )
        self._check_ids(tokens, "tokens")
        sampling_params = self._check_sampling(request.sampling or self.config.default_sampling)
        return tokens, sampling_params, self._key_data(request.rng, sampling_params)

    def _claim_all(self, requests: Sequence[PrefillRequest], rows) -> list[int]:
        """Paged: every request's pages, in order (`_claim`), after checking the pool holds them all."""
        pool, held, need = self._pages, {}, 0
        for request, (tokens, *_) in zip(requests, rows):
            length = len(tokens) - (0 if request.sample_first else 1)
            source = request.shared_from
            if source is not None and source not in held and (source == request.slot or not self._active[source]):
                raise ValueError(f"shared_from={source}: expected another occupied slot or an earlier request's")
            full = pool.pages_for(min(length + 1, self.config.cache_length))
            donor = held.get(source, 0 if source is None else int(pool.held[source]))
            need += full - (0 if source is None else min((length - 1) // self.config.page_size, donor))
            held[request.slot] = full
        free = pool.free_pages + sum(pool.releasable(slot) for slot in held)
        if need > free:
            raise OutOfPages(f"{len(requests)} prefills need {need} pages; {free} are free or freed by their slots")
        shared = []
        for request, (tokens, *_) in zip(requests, rows):
            length = len(tokens) - (0 if request.sample_first else 1)
            shared.append(self._claim(request.slot, length, request.shared_from))
        return shared

    def _batch_plan(self, lengths: Sequence[int]) -> list[tuple[int, int, list[int]]]:
        """Programs for prompts of `lengths`: (count C, bucket T, indices), the shortest first, each
        the most prompts a batched program takes (count 1: a bucket no batched program takes)."""
        programs = set(self.config.prefill_batches)
        plan, group = [], []
        for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
            grown = group + [i]
            bucket = self.config.prefill_bucket(max(lengths[j] for j in grown))
            if len(grown) == 1 or (_power_of_two(len(grown)), bucket) in programs:
                group = grown
                continue
            plan.append(group)
            group = [i]
        plan.append(group)
        out = []
        for members in plan:
            bucket = self.config.prefill_bucket(max(lengths[j] for j in members))
            count = _power_of_two(len(members)) if (2, bucket) in programs else 1
            out.append((count, bucket, members))
        return out

    def _dispatch_batch(self, params, decode_state, members, count: int, bucket: int, sampler):
        """One batched program over `members` [(request, (tokens, sampling, key data), shared pages)],
        padded to `count` rows of `bucket` tokens."""
        tokens_CT = np.zeros((count, bucket), np.int32)
        length_C = np.ones((count,), np.int32)
        slot_C = np.full((count,), self.config.num_slots, np.int32)  # past the slots: dropped
        key_data_C2 = np.zeros((count, 2), np.uint32)
        temperature_C, top_p_C = np.zeros((count,), np.float32), np.ones((count,), np.float32)
        top_k_C, sample_first_C = np.zeros((count,), np.int32), np.zeros((count,), bool)
        pages_CQ = None if self._pages is None else np.zeros((count, bucket // self.config.page_size), np.int32)
        for c, (request, (tokens, sampling_params, key_data), shared) in enumerate(members):
            tokens_CT[c, : len(tokens)] = tokens
            length_C[c], slot_C[c], key_data_C2[c] = len(tokens), request.slot, key_data
            temperature_C[c], top_p_C[c] = sampling_params.temperature, sampling_params.top_p
            top_k_C[c], sample_first_C[c] = sampling_params.top_k, request.sample_first
            if pages_CQ is not None:
                pages_CQ[c] = self._write_row(request.slot, bucket, shared)
        vectors = (tokens_CT, length_C, slot_C, key_data_C2, temperature_C, top_p_C, top_k_C, sample_first_C)
        pages = () if pages_CQ is None else (pages_CQ,)
        return self._prefill_insert_jit(params, decode_state, *vectors, *pages, sampler=sampler)

    def generate(
        self, params, decode_state: DecodeState, sampler: Callable | None = None
    ) -> tuple[DecodeState, ResultTokens]:
        """One decode step over every slot; donates decode_state. Paged, every occupied slot first
        takes the page its next row lands in (OutOfPages if the pool lacks them: `page_shortfall`
        says so beforehand)."""
        if self._pages is None:
            return self._generate_jit(params, decode_state, sampler=sampler)
        if self.page_shortfall():
            raise OutOfPages(
                f"the next decode step needs {self._decoding_shortfall()} more pages; {self._pages.free_pages} are free"
            )
        active, rows, lacking = self._growing()
        for slot, n in zip(active[lacking > 0].tolist(), rows[lacking > 0].tolist()):  # a new page every N steps
            self._pages.grow(slot, n)
        out = self._generate_jit(params, decode_state, self._device_table(), sampler=sampler)
        self._position[active] = np.minimum(self._position[active] + 1, self.config.cache_length - 1)
        return out

    # ------------------------------------------------------------------ migration
    def export_slot(
        self,
        decode_state: DecodeState,
        slot: int,
        *,
        request: Request,
        response_ids: Sequence[int],
        logprobs: Sequence[float],
        token_versions: Sequence[int],
        version: int,
        in_flight: int = 0,
        to_host: bool = True,
    ) -> SlotState:
        """The slot's device state (KV rows 0..position-1 on host, position, pending token, RNG key)
        joined with the host-side record the caller keeps; checked against each other.
        `to_host=False` leaves the KV rows on the slice's devices, laid out as a Prefix's and padded
        to their rows bucket (for a copy device to device: no host round trip).

        `in_flight`: decode steps the device has taken past the record (a pipelined worker's unread
        step). The slot is exported as the record stands: those steps only wrote rows at and past
        the record's position, and their tokens are dropped (the importer recomputes the same ones:
        sampling is counter-based per position)."""
        self._check_slot(slot)
        # The rows to read come from the host record (the device vector may span other processes);
        # the device's own position is checked against it below.
        expected = len(request.prompt_ids) + len(response_ids) - 1
        rows = self.config.rows_bucket(max(expected, 1))
        pages_Q = None if self._pages is None else self._page_row(slot, rows // self.config.page_size)
        k, v, *vectors = self._read_jit(decode_state, np.int32(slot), pages_Q, rows=rows)
        position, token, key_data = jax.device_get(vectors)
        if to_host:
            k, v = (np.asarray(x)[:, :expected] for x in jax.device_get((k, v)))
        else:
            k, v = jax.device_put((k, v), (self._prefix_shardings.k_LRKD, self._prefix_shardings.v_LRKD))
        position = int(position)
        pending = response_ids[-1] if response_ids else None
        if pending is None or position != expected + in_flight or (not in_flight and int(token) != pending):
            raise ValueError(
                f"slot {slot} holds position {position} / token {int(token)} but the record expects "
                f"position {expected} + {in_flight} in flight / token {pending}"
            )
        return SlotState(
            request=request,
            k_LSKD=k,
            v_LSKD=v,
            position=expected,
            last_token=int(pending),
            response_ids=tuple(int(t) for t in response_ids),
            logprobs=tuple(float(x) for x in logprobs),
            token_versions=tuple(int(x) for x in token_versions),
            rng_key=np.asarray(key_data, np.uint32),
            version=int(version),
        )

    def import_slot(self, decode_state: DecodeState, slot: int, state: SlotState) -> DecodeState:
        """Writes an exported slot into `slot`; decoding continues with no prefill (donates decode_state).
        Its KV rows are numpy (rows 0..position-1) or arrays on any devices (those rows or their rows
        bucket, as `export_slot(to_host=False)` leaves them: copied here device to device)."""
        cfg = self.model_config
        rows = self.config.rows_bucket(max(state.position, 1))
        shapes = [(cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim) for n in (state.position, rows)]
        if state.k_LSKD.shape not in shapes or state.v_LSKD.shape != state.k_LSKD.shape:
            raise ValueError(
                f"slot state KV has shapes {state.k_LSKD.shape} / {state.v_LSKD.shape}, expected {shapes[0]} "
                f"(or its rows bucket, {shapes[1]}) for this model"
            )
        if state.position + 1 > self.config.cache_length:
            raise ValueError(
                f"slot state position {state.position} does not fit cache_length={self.config.cache_length}"
            )
        params = self._check_sampling(state.request.sampling)
        pad = ((0, 0), (0, rows - state.k_LSKD.shape[1]), (0, 0), (0, 0))
        padded = lambda x: x if x.shape[1] == rows else np.pad(np.asarray(x), pad)  # noqa: E731
        prefix = Prefix(
            k_LRKD=padded(state.k_LSKD),
            v_LRKD=padded(state.v_LSKD),
            length=np.int32(state.position),
            token=np.int32(state.last_token),
            logp=np.float32(0.0),
            key_data=np.asarray(state.rng_key, np.uint32),
            temperature=np.float32(params.temperature),
            top_p=np.float32(params.top_p),
            top_k=np.int32(params.top_k),
            generated=np.int32(len(state.response_ids)),
        )
        prefix = jax.device_put(prefix, self._prefix_shardings)
        object.__setattr__(prefix, "_host_length", state.position)
        return self.insert(prefix, decode_state, slot)

    # ------------------------------------------------------------------ helpers
    def compile_counts(self) -> dict[str, int]:
        """Compiled programs per jitted function (for no-recompile checks)."""
        return {
            name: fn._cache_size()
            for name, fn in (
                ("prefill", self._prefill_jit),
                ("insert", self._insert_jit),
                ("generate", self._generate_jit),
                ("read_slot", self._read_jit),
                ("prefill_insert", self._prefill_insert_jit),
            )
        }

    def warmup(self, params, *, migration: bool = True) -> None:
        """Compiles generate (paged: at every page-table width), every prefill bucket, every batched
        prefill (`EngineConfig.prefill_batches`) and the second
        chunk of a two-chunk prefill (a re-prefill up to 2 x max_prefill_length); with `migration`,
        also the insert and slot read of every row bucket (so that imports and exports compile
        nothing later). Its own decode state: a live one's pages are left as they were."""
        held = (self._pages, self._position, self._active, self._table)
        try:
            self._warm(params, migration)
        finally:
            self._pages, self._position, self._active, self._table = held

    def _warm(self, params, migration: bool) -> None:
        state = self.init_decode_state()
        for bucket in self.config.prefill_buckets:
            run = lambda b=bucket: self.prefill(params=params, padded_tokens=np.zeros((b,), np.int32), true_length=b)
            prefix, _ = jax.block_until_ready(run())  # compiled; then timed (the migration rule's prefill cost)
            self.prefill_seconds[bucket] = min(_seconds(run) for _ in range(2))
            state = self.insert(prefix, state, 0)
        first = prefix  # the largest bucket's: a full first chunk
        for bucket in self.config.prefill_buckets:
            if self.config.max_prefill_length + bucket <= self.config.cache_length:
                prefix, _ = self.prefill(
                    params=params,
                    existing_prefix=first,
                    padded_tokens=np.zeros((bucket,), np.int32),
                    true_length=bucket,
                )
                state = self.insert(prefix, state, 0)
        for rows in sorted({self.config.rows_bucket(n) for n in range(1, self.config.max_prefill_length + 1)}):
            if self.config.paged and rows + self.config.min_prefill_bucket <= self.config.cache_length:
                shared = jax.device_put(_empty_prefix(self.model_config, rows), self._prefix_shardings)
                prefix, _ = self.prefill(  # a group's later sample: the rest of its prompt after shared pages
                    params=params,
                    existing_prefix=shared,
                    padded_tokens=np.zeros((1,), np.int32),
                    true_length=1,
                )
        for count, bucket in self.config.prefill_batches:  # padding rows only: nothing is written
            state, result = self._dispatch_batch(params, state, [], count, bucket, None)
        state, result = self.generate(params, state)
        for width in self._live_widths if self.config.paged else ():
            table = self._put_table(np.zeros((self.config.num_slots, width), np.int32))
            state, result = self._generate_jit(params, state, table, sampler=None)
        rows = sorted({self.config.rows_bucket(n) for n in range(1, self.config.cache_length + 1)}) if migration else []
        for size in rows:
            state = self.insert(
                jax.device_put(_empty_prefix(self.model_config, size), self._prefix_shardings), state, 0
            )
            pages_Q = None if self._pages is None else self._page_row(0, size // self.config.page_size)
            jax.block_until_ready(self._read_jit(state, np.int32(0), pages_Q, rows=size))
        jax.block_until_ready((state, result))

    def abstract_decode_state(self) -> DecodeState:
        """`init_decode_state()` as ShapeDtypeStructs carrying the slice's shardings (no memory)."""
        zero_state = jax.eval_shape(lambda: _zero_state(self.config, self.model_config, self._pack))
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), zero_state, self._state_shardings
        )

    def lower_programs(self) -> list[tuple[str, jax.stages.Lowered]]:
        """Every program `warmup` compiles, lowered on abstract params and decode state (nothing is
        placed or run), for ahead-of-time compilation (dora_jax.runtime.aot): [(name, Lowered)]
        with prefill per bucket, batched prefill_insert per (count, bucket), insert and read_slot per
        row bucket (an import is an insert), generate."""
        abstract = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
        params = jax.tree.map(abstract, split(abstract_model(self.model_config))[1], self._param_shardings)
        state = self.abstract_decode_state()
        scalars = (np.int32(0), np.int32(1), np.zeros((2,), np.uint32), np.float32(1), np.float32(1), np.int32(0))
        programs = []
        for bucket in self.config.prefill_buckets:
            tokens = jax.ShapeDtypeStruct((bucket,), jnp.int32)
            lowered = self._prefill_jit.lower(params, tokens, None, *scalars, np.bool_(True), sampler=None)
            programs.append((f"prefill[T={bucket}]", lowered))
        for count, bucket in self.config.prefill_batches:
            lowered = self._prefill_insert_jit.lower(
                params, state, *_batch_shapes(self.config, count, bucket), sampler=None
            )
            programs.append((f"prefill_insert[C={count},T={bucket}]", lowered))
        if self.config.paged:
            replicated = sharding_lib.replicated(self._mesh)
            for width in self._live_widths:
                table = jax.ShapeDtypeStruct((self.config.num_slots, width), jnp.int32, sharding=replicated)
                lowered = self._generate_jit.lower(params, state, table, sampler=None)
                widest = width == self.config.pages_per_slot
                programs.append(("generate" if widest else f"generate[pages={width}]", lowered))
        else:
            programs.append(("generate", self._generate_jit.lower(params, state, sampler=None)))
        cfg = self.model_config
        one_row = jax.tree.map(abstract, _empty_prefix(cfg, 1), self._prefix_shardings)
        for rows in sorted({self.config.rows_bucket(n) for n in range(1, self.config.cache_length + 1)}):
            kv_shape = (cfg.num_layers, rows, cfg.num_kv_heads, cfg.head_dim)
            kv = jax.ShapeDtypeStruct(kv_shape, jnp.dtype(cfg.dtype), sharding=self._prefix_shardings.k_LRKD)
            prefix = one_row.replace(k_LRKD=kv, v_LRKD=kv)
            pages_Q = None if not self.config.paged else np.zeros((rows // self.config.page_size,), np.int32)
            programs.append((f"insert[rows={rows}]", self._insert_jit.lower(prefix, state, np.int32(0), pages_Q)))
            programs.append((f"read_slot[rows={rows}]", self._read_jit.lower(state, np.int32(0), pages_Q, rows=rows)))
        return programs

    @property
    def param_shardings(self) -> Any:
        """NamedShardings of the params on this slice (a tree like `models.split(model)[1]`)."""
        return self._param_shardings

    def served_abstract_params(self) -> Any:
        """ShapeDtypeStructs of the params as a version is served here: this slice's shardings, the
        floating leaves in the compute dtype (what a device-to-device pull asks for)."""
        abstract = split(abstract_model(self.model_config))[1]
        return served_abstract(abstract, self._param_shardings, self.model_config.dtype)

    def _key_data(self, rng, params: SamplingParams) -> np.ndarray:
        if rng is None:
            return sampling.base_key_data(params.seed)
        if isinstance(rng, jax.Array) and jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
            rng = jax.random.key_data(rng)
        rng = np.asarray(rng, np.uint32)
        if rng.shape != (2,):
            raise ValueError(f"rng has shape {rng.shape}; expected a threefry key or uint32[2] key data")
        return rng

    def _check_slot(self, slot: int) -> None:
        if not 0 <= int(slot) < self.config.num_slots:
            raise ValueError(f"slot={slot}; expected 0..{self.config.num_slots - 1}")

    def _check_ids(self, ids: np.ndarray, field: str) -> None:
        bad = ids[(ids < 0) | (ids >= self.model_config.vocab_size)]
        if bad.size:
            raise ValueError(
                f"{field} holds token id {int(bad[0])} outside the vocabulary [0, {self.model_config.vocab_size})"
            )

    def _check_sampling(self, params: SamplingParams) -> SamplingParams:
        problem = check_sampling(params, filters=self.config.sampling_filters)
        if problem:
            raise ValueError(problem)
        return params


def check_sampling(params: SamplingParams, *, filters: bool = True) -> str | None:
    """An error naming the bad field, or None. `filters`: whether the engine was built with top-k /
    top-p filtering (EngineConfig.sampling_filters)."""
    if not params.temperature >= 0:
        return f"sampling.temperature={params.temperature}; expected >= 0 (0 = greedy)"
    if not 0 < params.top_p <= 1:
        return f"sampling.top_p={params.top_p}; expected 0 < top_p <= 1"
    if params.top_k < 0:
        return f"sampling.top_k={params.top_k}; expected >= 0 (0 = off)"
    if not filters and params.temperature > 0 and (params.top_k > 0 or params.top_p < 1):
        return (
            f"sampling.top_k={params.top_k}, sampling.top_p={params.top_p}: this engine was built without "
            "top-k/top-p filtering (EngineConfig.sampling_filters=False, as a run whose rollout.top_k is 0 and "
            "rollout.top_p is 1 builds it); expected top_k=0 and top_p=1"
        )
    return None
