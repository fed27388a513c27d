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

This module is the serving class; what it serves lives beside it: the static sizes
(`engine_config`), the device state (`engine_state`), the jitted programs and how many there are
(`programs`), the paged cache's host bookkeeping (`slot_pages` over `pages`), batched prefill
(`batched_prefill`: several prompts in one program, as `prefill` + `insert` of each) and a slot's
export and import (`slot_transfer`). Their public names are importable from here as before.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from dora_jax.core.records import Request, SamplingParams, SlotState
from dora_jax.models import (
    KV_CACHE_AXES,
    PAGED_KV_AXES,
    KVCache,
    ModelConfig,
    abstract_model,
    in_compute_dtype,
    load_hf,
    logical_axes,
    paged,
    served_abstract,
    split,
)
from dora_jax.parallel import sharding as sharding_lib
from dora_jax.rollout import sampling, slot_transfer
from dora_jax.rollout.batched_prefill import PrefillRequest, batch_arrays, batch_plan, batch_shapes
from dora_jax.rollout.engine_config import EngineConfig, KVPoolTooSmall, check_sampling, size_pool
from dora_jax.rollout.engine_state import (
    PREFIX_KV_AXES,
    DecodeState,
    Prefix,
    ResultTokens,
    empty_prefix,
    host_length,
    pool_pack,
    with_host_length,
)
from dora_jax.rollout.pages import OutOfPages, PagePool
from dora_jax.rollout.programs import decode_state_shapes, engine_programs
from dora_jax.rollout.slot_pages import SlotPages

# Names other modules import from here (they moved to the modules above).
__all__ = [
    "DecodeState",
    "EngineConfig",
    "KVPoolTooSmall",
    "OutOfPages",
    "PagePool",
    "PrefillRequest",
    "Prefix",
    "ResultTokens",
    "RolloutEngine",
    "check_sampling",
]


def _seconds(fn: Callable) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


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
        self._pack = pool_pack(model_config, mesh, rules)  # 0: a split pool; else kv heads per row
        self.tokenizer = tokenizer
        abstract = abstract_model(model_config)
        self._graphdef, abstract_params = split(abstract)
        self._param_shardings = sharding_lib.tree_shardings(logical_axes(abstract), abstract_params, mesh, rules)
        self.config = config = self._sized(config, hbm_bytes)
        self._param_structure = jax.tree.structure(abstract_params)
        self._param_shapes = [tuple(x.shape) for x in jax.tree.leaves(abstract_params)]
        self._state_shardings = self._shardings_for(decode_state_shapes(config, model_config, self._pack))
        self._prefix_shardings = self._prefix_sharding_tree()
        # Engines with the same model, sizes and mesh share compiled programs (a worker per
        # time-shared slice, a re-created engine) instead of compiling them again.
        self._programs = engine_programs(
            model_config, config, mesh, rules, self._graphdef, self._state_shardings, self._prefix_shardings
        )
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
        if hbm_bytes is None:
            hbm_bytes = (self._mesh.local_devices[0].memory_stats() or {}).get("bytes_limit")
        if not hbm_bytes:
            return dataclasses.replace(config, num_pages=config.pool_pages)
        return size_pool(config, hbm_bytes - self.served_bytes_per_chip(), self.kv_bytes_per_page())

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
        self._slots: SlotPages | None = SlotPages(self.config, self._live_widths) if self.config.paged else None

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
            PREFIX_KV_AXES, (cfg.num_layers, self.config.min_prefill_bucket, cfg.num_kv_heads, cfg.head_dim)
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
        if self._slots is not None:
            self._slots.release(slot)

    # ------------------------------------------------------------------ pages
    @property
    def pages(self) -> PagePool | None:
        """The host's page pool of the live decode state (None: dense cache)."""
        return None if self._slots is None else self._slots.pool

    def page_shortfall(self) -> int:
        """Pages the next `generate` needs beyond those free (> 0: it would raise OutOfPages; the
        caller preempts first). 0 for a dense cache."""
        return 0 if self._slots is None else self._slots.step_shortfall()

    def admit_shortfall(self, slot: int, tokens: int, *, reserved: int = 0) -> int:
        """Pages short of admitting `tokens` prefilled tokens into `slot` now while keeping the
        pages the other slots' next step needs and `reserved` pages promised to requests admitted
        with it (0: admit). 0 for a dense cache."""
        return 0 if self._slots is None else self._slots.admit_shortfall(slot, tokens, reserved=reserved)

    def pages_for_prefill(self, tokens: int) -> int:
        """Pages a slot takes for `tokens` prefilled tokens and its pending token's row (0: dense)."""
        return 0 if self._slots is None else self._slots.pages_for_prefill(tokens)

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
        return self._programs.init()

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
        prefix, result = self._programs.prefill(
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
        return with_host_length(prefix, start + true_length - (0 if sample_first else 1)), result

    def shared_prefix(self, decode_state: DecodeState, source: int, tokens: int) -> Prefix | None:
        """Paged: the first rows of a prompt of `tokens` tokens that slot `source` holds, as a Prefix
        for `prefill(existing_prefix=...)` of the rest (less than a page) and then
        `insert(..., shared_from=source)`: the new slot takes `source`'s whole pages below the prompt's
        end by reference instead of prefilling and storing the prompt again (a GRPO group's G samples).
        None when there is no whole page to share, or for a dense cache."""
        shared = 0 if self._slots is None else self._slots.shareable(source, tokens)
        if not shared:
            return None
        N = self.config.page_size
        rows = self.config.rows_bucket(shared * N)
        pages_Q = self._slots.page_row(source, rows // N)
        k, v, *_ = self._programs.read_slot(decode_state, np.int32(source), pages_Q, rows=rows)
        k, v = jax.device_put((k, v), (self._prefix_shardings.k_LRKD, self._prefix_shardings.v_LRKD))
        prefix = empty_prefix(self.model_config, 1).replace(k_LRKD=k, v_LRKD=v, length=np.int32(shared * N))
        return with_host_length(prefix, shared * N)

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
        if self._slots is None:
            return self._programs.insert(prefix, decode_state, np.int32(slot))
        shared = self._slots.claim(slot, host_length(prefix), shared_from)
        return self._programs.insert(prefix, decode_state, np.int32(slot), self._slots.write_row(slot, rows, shared))

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
        if self._slots is None:
            shared = [0] * len(requests)
        else:  # every request's pages, after checking the pool holds them all
            lengths = [len(tokens) - (0 if r.sample_first else 1) for r, (tokens, *_) in zip(requests, rows)]
            shared = self._slots.claim_all([(r.slot, n, r.shared_from) for r, n in zip(requests, lengths)])
        out = []
        for count, bucket, members in batch_plan(self.config, [len(tokens) for tokens, *_ in rows]):
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
                pages_Q = None if self._slots is None else self._slots.write_row(slots[i], bucket, shared[i])
                args = () if pages_Q is None else (pages_Q,)
                decode_state = self._programs.insert(prefix, decode_state, np.int32(slots[i]), *args)
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

    def _dispatch_batch(self, params, decode_state, members, count: int, bucket: int, sampler):
        """One batched program over `members` [(request, (tokens, sampling, key data), shared pages)],
        padded to `count` rows of `bucket` tokens."""
        arrays = batch_arrays(self.config, members, count, bucket, self._slots)
        return self._programs.prefill_insert(params, decode_state, *arrays, sampler=sampler)

    def generate(
        self, params, decode_state: DecodeState, sampler: Callable | None = None
    ) -> tuple[DecodeState, ResultTokens]:
        """One decode step over every slot; donates decode_state. Paged, every occupied slot first
        takes the page its next row lands in (OutOfPages if the pool lacks them: `page_shortfall`
        says so beforehand)."""
        if self._slots is None:
            return self._programs.generate(params, decode_state, sampler=sampler)
        active = self._slots.grow_for_step()
        out = self._programs.generate(params, decode_state, self._slots.device_table(self._put_table), sampler=sampler)
        self._slots.stepped(active)
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
        expected, rows = slot_transfer.export_rows(self.config, request, response_ids)
        pages_Q = None if self._slots is None else self._slots.page_row(slot, rows // self.config.page_size)
        k, v, *vectors = self._programs.read_slot(decode_state, np.int32(slot), pages_Q, rows=rows)
        position, token, key_data = jax.device_get(vectors)
        if to_host:
            k, v = (np.asarray(x)[:, :expected] for x in jax.device_get((k, v)))
        else:
            k, v = jax.device_put((k, v), (self._prefix_shardings.k_LRKD, self._prefix_shardings.v_LRKD))
        return slot_transfer.slot_state(
            slot,
            k,
            v,
            position,
            token,
            key_data,
            expected=expected,
            in_flight=in_flight,
            request=request,
            response_ids=response_ids,
            logprobs=logprobs,
            token_versions=token_versions,
            version=version,
        )

    def import_slot(self, decode_state: DecodeState, slot: int, state: SlotState) -> DecodeState:
        """Writes an exported slot into `slot`; decoding continues with no prefill (donates decode_state).
        Its KV rows are numpy (rows 0..position-1) or arrays on any devices (those rows or their rows
        bucket, as `export_slot(to_host=False)` leaves them: copied here device to device)."""
        prefix = slot_transfer.import_prefix(self.model_config, self.config, state)
        prefix = with_host_length(jax.device_put(prefix, self._prefix_shardings), state.position)
        return self.insert(prefix, decode_state, slot)

    # ------------------------------------------------------------------ helpers
    def compile_counts(self) -> dict[str, int]:
        """Compiled programs per jitted function (for no-recompile checks)."""
        return {
            name: fn._cache_size()
            for name, fn in (
                ("prefill", self._programs.prefill),
                ("insert", self._programs.insert),
                ("generate", self._programs.generate),
                ("read_slot", self._programs.read_slot),
                ("prefill_insert", self._programs.prefill_insert),
            )
        }

    def warmup(self, params, *, migration: bool = True) -> None:
        """Compiles generate (paged: at every page-table width), every prefill bucket, every batched
        prefill (`EngineConfig.prefill_batches`) and the second
        chunk of a two-chunk prefill (a re-prefill up to 2 x max_prefill_length); with `migration`,
        also the insert and slot read of every row bucket (so that imports and exports compile
        nothing later). Its own decode state: a live one's pages are left as they were."""
        held = self._slots
        try:
            self._warm(params, migration)
        finally:
            self._slots = held

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
                shared = jax.device_put(empty_prefix(self.model_config, rows), self._prefix_shardings)
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
            state, result = self._programs.generate(params, state, table, sampler=None)
        rows = sorted({self.config.rows_bucket(n) for n in range(1, self.config.cache_length + 1)}) if migration else []
        for size in rows:
            state = self.insert(jax.device_put(empty_prefix(self.model_config, size), self._prefix_shardings), state, 0)
            pages_Q = None if self._slots is None else self._slots.page_row(0, size // self.config.page_size)
            jax.block_until_ready(self._programs.read_slot(state, np.int32(0), pages_Q, rows=size))
        jax.block_until_ready((state, result))

    def abstract_decode_state(self) -> DecodeState:
        """`init_decode_state()` as ShapeDtypeStructs carrying the slice's shardings (no memory)."""
        zero_state = decode_state_shapes(self.config, self.model_config, self._pack)
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
            lowered = self._programs.prefill.lower(params, tokens, None, *scalars, np.bool_(True), sampler=None)
            programs.append((f"prefill[T={bucket}]", lowered))
        for count, bucket in self.config.prefill_batches:
            lowered = self._programs.prefill_insert.lower(
                params, state, *batch_shapes(self.config, count, bucket), sampler=None
            )
            programs.append((f"prefill_insert[C={count},T={bucket}]", lowered))
        if self.config.paged:
            replicated = sharding_lib.replicated(self._mesh)
            for width in self._live_widths:
                table = jax.ShapeDtypeStruct((self.config.num_slots, width), jnp.int32, sharding=replicated)
                lowered = self._programs.generate.lower(params, state, table, sampler=None)
                widest = width == self.config.pages_per_slot
                programs.append(("generate" if widest else f"generate[pages={width}]", lowered))
        else:
            programs.append(("generate", self._programs.generate.lower(params, state, sampler=None)))
        cfg = self.model_config
        one_row = jax.tree.map(abstract, empty_prefix(cfg, 1), self._prefix_shardings)
        for rows in sorted({self.config.rows_bucket(n) for n in range(1, self.config.cache_length + 1)}):
            kv_shape = (cfg.num_layers, rows, cfg.num_kv_heads, cfg.head_dim)
            kv = jax.ShapeDtypeStruct(kv_shape, jnp.dtype(cfg.dtype), sharding=self._prefix_shardings.k_LRKD)
            prefix = one_row.replace(k_LRKD=kv, v_LRKD=kv)
            pages_Q = None if not self.config.paged else np.zeros((rows // self.config.page_size,), np.int32)
            programs.append((f"insert[rows={rows}]", self._programs.insert.lower(prefix, state, np.int32(0), pages_Q)))
            programs.append(
                (f"read_slot[rows={rows}]", self._programs.read_slot.lower(state, np.int32(0), pages_Q, rows=rows))
            )
        return programs

    @property
    def graphdef(self) -> Any:
        """The served model's graph (params apart): a full forward (`nnx.merge(graphdef, params)`)."""
        return self._graphdef

    @property
    def rules(self) -> sharding_lib.Rules:
        """The sharding rule table of this slice's mesh."""
        return self._rules

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
