"""The train step with length-bucketed micro-batches (`trainer.length_buckets`).

Long-tailed responses make a fixed-shape step pay for the longest sample in every row: with a
median of 20 tokens and a tail of 300, nine tenths of a padded batch is padding. Here the rows
of each update are sorted by length and cut into micro-batches of C rows, and each micro-batch
is padded only to its own bucket (`pad_to * 2^k`), so short rows cost short forwards. The maths
is that of `step.train_step`: advantages and token weights over the whole batch / mini-batch
first, micro-batch gradients summed, one optimizer update per mini-batch (`step.apply_grads`);
tests/trainer/test_bucketed.py checks the two give the same params.

The host drives the loop: one jitted gradient function per bucket shape (a handful per run),
one jitted update. Behaviour log-probs are recomputed first, per version in length-sorted chunks
of C rows, each at its own bucket, and read back to host (gathered from every process when the
trainer mesh spans several hosts, which all run this loop on the same batch).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from dora_jax.core.records import TrainBatch
from dora_jax.trainer.batching import bucket_length
from dora_jax.trainer.loss import LossStats, row_weights, token_weights, weights_scale
from dora_jax.trainer.step import StepOutputs, _micro_loss, apply_grads, batch_advantages


def row_lengths(batch: TrainBatch) -> np.ndarray:
    """Positions each row really uses: up to its last response token (1 for an empty row)."""
    mask = np.asarray(batch.loss_mask_BT) > 0
    last = mask.shape[1] - np.argmax(mask[:, ::-1], axis=1)
    return np.where(mask.any(1), last, 1)


class Micro(NamedTuple):
    """One micro-batch: its batch rows (longest first), the positions it is padded to, and the
    rows of its compiled shape (`size` >= len(rows); the rest are empty padding rows)."""

    rows: np.ndarray
    length: int
    size: int


class Partial(NamedTuple):
    """Sums over some micro-batches of one update at one set of params: gradients (None for none),
    loss, LossStats, router load, aux loss, and how many micro-batches."""

    grads: Any
    loss: Any
    stats: LossStats | None
    load: Any
    aux: Any
    micros: int


def micro_rows(length: int, *, micro_batch_size: int, token_budget: int, shards: int, limit: int) -> int:
    """Rows of a micro-batch padded to `length` positions: `micro_batch_size`; with a token budget,
    the most rows within `token_budget` positions, `shards * 2^k` (at least one row per batch
    shard) and at most `limit` (one update's rows). One row count per length: bounded compiles."""
    if not token_budget:
        return micro_batch_size
    per_shard = max(1, token_budget // (length * shards))
    rows = shards * (1 << (per_shard.bit_length() - 1))
    return max(shards, min(rows, limit - limit % shards))


def micro_plan(
    lengths_B: np.ndarray,
    num_updates: int,
    micro_batch_size: int,
    pad_to: int,
    *,
    width: int | None = None,
    token_budget: int = 0,
    shards: int = 1,
    max_rows: int | None = None,
) -> list[list[Micro]]:
    """[[Micro, ...] per update]: each update's rows sorted longest first and cut into
    micro-batches, each padded to the bucket of its longest row (`pad_to * 2^k`, at most the
    batch's `width`). Without a token budget every micro-batch has `micro_batch_size` rows; with
    one, long rows share a micro-batch with few others and short rows with many (`micro_rows`), up
    to `max_rows` (default: the whole update)."""
    B = lengths_B.shape[0]
    per_update = B // num_updates
    plan = []
    for u in range(num_updates):
        rows = np.arange(u * per_update, (u + 1) * per_update)
        rows = rows[np.argsort(-lengths_B[rows], kind="stable")]
        micros, start = [], 0
        while start < per_update:
            length = bucket_length(int(lengths_B[rows[start]]), pad_to, width)
            size = micro_rows(
                length,
                micro_batch_size=micro_batch_size,
                token_budget=token_budget,
                shards=shards,
                limit=max_rows or per_update,
            )
            micros.append(Micro(rows[start : start + size], length, size))
            start += size
        plan.append(micros)
    return plan


def bucket_lengths(max_length: int, pad_to: int, widths=(None,)) -> list[int]:
    """Every micro-batch length a row of up to `max_length` positions can get, in a batch of any of
    `widths` positions (None: uncapped)."""
    lengths = set()
    for width in widths:
        longest = max_length if width is None else min(width, max_length)
        length = pad_to
        while True:
            lengths.add(length if width is None else min(length, width))
            if length >= longest:
                break
            length *= 2
    return sorted(lengths)


def batch_widths(max_length: int, pad_to: int) -> tuple[int, ...]:
    """Every width a batch of rows up to `max_length` positions can have (`make_train_batch`):
    pad_to * 2^k up to the bucket of the longest row, `max_length` where that is narrower."""
    return tuple(sorted({min(width, max_length) for width in bucket_lengths(max_length, pad_to)}))


class BucketedStep:
    """Runs one batch as `step.train_step` would, micro-batch by micro-batch at their own lengths."""

    def __init__(
        self,
        graphdef,
        tx,
        config,
        mesh,
        batch_axes,
        param_shardings,
        state_shardings,
        replicated,
        behaviour,
        *,
        pad_to: int,
        shards: int = 1,
        compiler_options=None,
        on_trace=lambda: None,
        layout=contextlib.nullcontext,
    ):
        self._config, self._pad_to, self._behaviour, self._shards = config, pad_to, behaviour, shards
        self._rows_CT = NamedSharding(mesh, PartitionSpec(batch_axes, None))
        self._rows_C = NamedSharding(mesh, PartitionSpec(batch_axes))
        self._rows_UMCT = NamedSharding(mesh, PartitionSpec(None, None, batch_axes, None))
        self._replicated = replicated
        loss_config = config.loss_config()

        def grad(params, micro, weights_CT, ref_params, micro_batches):
            on_trace()
            fn = functools.partial(
                _micro_loss,
                graphdef=graphdef,
                loss_config=loss_config,
                router_aux_coef=config.router_aux_coef,
                micro_batches=micro_batches,
            )
            with layout():
                return jax.value_and_grad(fn, has_aux=True)(params, micro, weights_CT, ref_params)

        # `micro_batches` is traced: with a token budget the count varies from update to update.
        self._grad = jax.jit(
            grad, out_shardings=((replicated, replicated), param_shardings), compiler_options=compiler_options
        )
        self._add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b), donate_argnums=(0,))
        self._apply = jax.jit(
            functools.partial(apply_grads, tx=tx),
            donate_argnums=(0,),
            out_shardings=(state_shardings, replicated, replicated),
            compiler_options=compiler_options,
        )
        self._advantages = jax.jit(
            functools.partial(batch_advantages, estimator=config.advantage, dynamic_sampling=config.dynamic_sampling)
        )
        self._weights = jax.jit(
            functools.partial(token_weights, loss_norm=loss_config.loss_norm, t_max=loss_config.t_max)
        )
        self._row_weights = jax.jit(functools.partial(row_weights, loss_norm=loss_config.loss_norm))
        self._scale_of = jax.jit(
            functools.partial(weights_scale, loss_norm=loss_config.loss_norm, t_max=loss_config.t_max)
        )
        self._scaled = jax.jit(lambda a, s: jax.tree.map(lambda x: x * s, a))
        self._add_scaled = jax.jit(lambda a, b, s: jax.tree.map(lambda x, y: x + y * s, a, b), donate_argnums=(0,))

    def plan(
        self, lengths_B: np.ndarray, width: int, num_updates: int, max_rows: int | None = None
    ) -> list[list[Micro]]:
        c = self._config
        return micro_plan(
            lengths_B,
            num_updates,
            c.micro_batch_size,
            self._pad_to,
            width=width,
            token_budget=c.micro_batch_tokens,
            shards=self._shards,
            max_rows=max_rows,
        )

    def __call__(self, state, batch: TrainBatch, ref_params, params_of, current_B=None, known_B=None, ahead=None):
        """`current_B` ([B] bool): rows whose behaviour log-probs are the gradient forward's own (the
        rows the current params generated, trained on before any update moves them): not recomputed.
        `known_B` ([B] bool): rows whose behaviour log-probs came with the batch
        (`batch.behaviour_logps_BT`, scored by their rollout slice): used as they are, not recomputed.
        `ahead`: (Partial, [B] bool rows it holds): those rows' gradient sums, computed at these
        params with `row_weights` (`partial`); one update only (`trainer.grad_ahead`). The step
        computes the other rows and scales the held sums by the batch's `weights_scale`."""
        c = self._config
        ahead_B = np.zeros(batch.batch_size, bool) if ahead is None else np.asarray(ahead[1], bool)
        if ahead is not None and c.num_updates != 1:
            raise ValueError(f"gradients computed ahead need trainer.num_updates=1, not {c.num_updates}")
        x = self._inputs(batch, params_of, current_B, known_B, skip_B=ahead_B)
        mask_BT, lengths_B = x["mask"], x["lengths"]
        width = mask_BT.shape[1]
        plan = self.plan(lengths_B, width, c.num_updates)
        per_update = batch.batch_size // c.num_updates
        losses, norms, finites, stats, load, aux = [], [], [], None, None, []
        for u, micros in enumerate(plan):
            rows_u = np.arange(u * per_update, (u + 1) * per_update)
            weights_BT = np.zeros_like(mask_BT)
            weights_BT[rows_u] = np.asarray(self._weights(mask_BT[rows_u]))  # over the whole mini-batch
            if ahead is not None:  # the rows not computed ahead, cut as a plan of their own
                micros = self._plan_rows(lengths_B, np.flatnonzero(~ahead_B), width, per_update)
            part = self._micros(state.params, micros, x, weights_BT, ref_params)
            if ahead is not None:
                scale = self._scale_of(mask_BT[rows_u])
                part = self._join(part, ahead[0], scale)
            state, grad_norm, finite = self._apply(state, part.grads, jnp.asarray(part.loss, jnp.float32))
            losses.append(part.loss)
            norms.append(grad_norm)
            finites.append(finite)
            aux.append(part.aux / max(part.micros, 1))
            stats = part.stats if stats is None else stats.merge(part.stats)
            load = part.load if load is None else load + part.load
        outputs = StepOutputs(
            loss=jnp.mean(jnp.stack(losses)),
            grad_norm=jnp.mean(jnp.stack(norms)),
            finite_U=jnp.stack(finites).astype(jnp.int32),
            dropped_groups=x["dropped"],
            updates=state.updates,
            stats=stats if stats is not None else LossStats.empty(),
            router_load_LX=load,
            router_aux_loss=jnp.mean(jnp.stack(aux)),
        )
        return state, outputs

    def partial(
        self, state, batch: TrainBatch, ref_params, params_of, rows_B, current_B=None, known_B=None, full_only=False
    ) -> tuple[Partial | None, np.ndarray]:
        """`trainer.grad_ahead`: the gradient sums of `batch`'s `rows_B` rows (of whole groups:
        their advantages are their groups') at `state`'s params, with `row_weights` (the
        batch-level factor is applied by the step that holds them, `__call__`'s `ahead`). `batch`
        is packed as a training batch (its size: the update's rows), so that the micro-batches take
        the shapes `warmup` compiled. `full_only`: only the micro-batches that `rows_B` fill (a
        micro-batch of a few real rows costs as much as a full one; its rows are left to a later
        call or to the step). Returns (a Partial, its grads on the trainer mesh, or None when no
        micro-batch is computed; [B] bool of the rows it covers)."""
        lengths_B = row_lengths(batch)
        micros = self._plan_rows(lengths_B, np.flatnonzero(rows_B), batch.tokens_BT.shape[1], batch.batch_size)
        if full_only:
            micros = [m for m in micros if m.rows.size == m.size]
        covered_B = np.zeros(batch.batch_size, bool)
        for m in micros:
            covered_B[m.rows] = True
        if not micros:
            return None, covered_B
        x = self._inputs(batch, params_of, current_B, known_B, skip_B=~covered_B)
        weights_BT = np.asarray(self._row_weights(x["mask"]))
        return self._micros(state.params, micros, x, weights_BT, ref_params), covered_B

    def add(self, a: Partial, b: Partial) -> Partial:
        """Two Partials of one update's rows, summed (`a`'s grads are donated)."""
        return Partial(
            self._add(a.grads, b.grads),
            a.loss + b.loss,
            a.stats.merge(b.stats),
            a.load + b.load,
            a.aux + b.aux,
            a.micros + b.micros,
        )

    def _join(self, part: Partial, ahead: Partial, scale) -> Partial:
        """The step's rows (`part`, weighted over the whole batch) and the rows computed ahead
        (`row_weights`), the latter scaled by the batch's factor."""
        if part.grads is None:  # every row was computed ahead
            return Partial(
                self._scaled(ahead.grads, scale), scale * ahead.loss, ahead.stats, ahead.load, ahead.aux, ahead.micros
            )
        return Partial(
            self._add_scaled(part.grads, ahead.grads, scale),
            part.loss + scale * ahead.loss,
            part.stats.merge(ahead.stats),
            part.load + ahead.load,
            part.aux + ahead.aux,
            part.micros + ahead.micros,
        )

    def _plan_rows(self, lengths_B: np.ndarray, rows: np.ndarray, width: int, per_update: int) -> list[Micro]:
        """One update's micro-batches over the batch rows `rows` only, at the shapes of a plan over
        `per_update` rows (those `warmup` compiled)."""
        if rows.size == 0:
            return []
        micros = self.plan(lengths_B[rows], width, 1, max_rows=per_update)[0]
        return [Micro(rows[m.rows], m.length, m.size) for m in micros]

    def _inputs(self, batch: TrainBatch, params_of, current_B, known_B, skip_B) -> dict:
        """The step's per-row host arrays: advantages (per group), the loss mask with DAPO's
        dropped groups out, tokens, inference and behaviour log-probs (recomputed for the rows
        that are neither current, known nor in `skip_B`), lengths."""
        adv_B, valid_B, dropped = jax.device_get(
            self._advantages(
                np.asarray(batch.rewards_B, np.float32),
                np.asarray(batch.group_ids_B, np.int32),
                np.asarray(batch.valid_B, np.float32),
            )
        )
        versions_B = np.asarray(batch.versions_B, np.int64)
        tokens_BT = np.asarray(batch.tokens_BT, np.int32)
        lengths_B = row_lengths(batch)
        current_B = np.zeros(batch.batch_size, bool) if current_B is None else np.asarray(current_B, bool)
        known_B = np.zeros(batch.batch_size, bool) if known_B is None else np.asarray(known_B, bool)
        behaviour_BT = self._behaviour_logps(tokens_BT, versions_B, lengths_B, params_of, current_B, known_B | skip_B)
        if known_B.any():
            behaviour_BT[known_B] = np.asarray(batch.behaviour_logps_BT, np.float32)[known_B]
        return dict(
            adv=adv_B,
            dropped=dropped,
            mask=np.asarray(batch.loss_mask_BT, np.float32) * valid_B[:, None],
            tokens=tokens_BT,
            inference=np.asarray(batch.inference_logps_BT, np.float32),
            behaviour=behaviour_BT,
            current=current_B,
            lengths=lengths_B,
        )

    def _micros(self, params, micros: list[Micro], x: dict, weights_BT: np.ndarray, ref_params) -> Partial:
        """The summed gradient, loss, stats, router load and aux loss of `micros` at `params`."""
        grads, loss, stats, load, aux = None, 0.0, None, None, 0.0
        count = np.float32(len(micros))
        for m in micros:
            rows_of = functools.partial(_padded_rows, m)  # padding rows: empty (zero mask and weight)
            micro = dict(
                tokens=self._put(rows_of(x["tokens"])),
                mask=self._put(rows_of(x["mask"])),
                inference=self._put(rows_of(x["inference"])),
                behaviour=self._put(rows_of(x["behaviour"])),
                adv=jax.device_put(rows_of(x["adv"]), self._rows_C),
                current=jax.device_put(rows_of(x["current"].astype(np.float32)), self._rows_C),
            )
            (micro_loss, (micro_stats, (micro_load, micro_aux))), micro_grads = self._grad(
                params, micro, self._put(rows_of(weights_BT)), ref_params, count
            )
            grads = micro_grads if grads is None else self._add(grads, micro_grads)
            loss = loss + micro_loss
            aux = aux + micro_aux
            stats = micro_stats if stats is None else stats.merge(micro_stats)
            load = micro_load if load is None else load + micro_load
        return Partial(grads, loss, stats, load, aux, len(micros))

    def behaviour_logps(self, batch: TrainBatch, params_of, skip_B: np.ndarray) -> np.ndarray:
        """[B, T] behaviour log-probs on the host of the rows not in `skip_B` (the rest 0), in the
        step's own recompute chunks (no program of its own)."""
        tokens_BT = np.asarray(batch.tokens_BT, np.int32)
        versions_B = np.asarray(batch.versions_B, np.int64)
        return self._behaviour_logps(tokens_BT, versions_B, row_lengths(batch), params_of, np.asarray(skip_B, bool))

    def _behaviour_logps(self, tokens_BT, versions_B, lengths_B, params_of, current_B, known_B=None) -> np.ndarray:
        """[B, T] behaviour log-probs on the host, computed before any update (the updates donate
        the current params, the behaviour policy of the newest samples), except the `current_B`
        rows (left 0: the gradient forward gives theirs). Rows are grouped by version and cut as
        the micro-batches are, at most `micro_batch_size` rows a chunk (one forward per chunk, at
        its own length): a version may hold only a few rows. The `known_B` rows are skipped too
        (left 0: their log-probs came with the batch)."""
        out = np.zeros(tokens_BT.shape, np.float32)
        wanted_B = ~current_B if known_B is None else ~(current_B | known_B)
        for version in np.unique(versions_B[wanted_B]):
            rows = np.flatnonzero((versions_B == version) & wanted_B)
            for chunk in self.plan(lengths_B[rows], tokens_BT.shape[1], 1, self._config.micro_batch_size)[0]:
                part = rows[chunk.rows]
                padded = np.concatenate([part, np.full(chunk.size - part.size, part[0])])
                logps = self._behaviour(
                    jax.device_put(tokens_BT[padded, : chunk.length][None, None], self._rows_UMCT),
                    versions_B[padded],
                    params_of,
                    chunk=chunk.size,
                )
                # The chunk's rows are sharded over the mesh, which may span several processes
                # (a multi-host trainer): each host gathers the whole chunk (in one process, this
                # is np.asarray).
                out[part, : chunk.length] = multihost_utils.process_allgather(logps, tiled=True)[0, 0, : part.size]
        return out

    def warmup(
        self, state, ref_params, version: int, max_length: int, rows_per_update: int, params_of, widths=(None,)
    ) -> list[int]:
        """Compiles every micro-batch shape a row of up to `max_length` positions can get in a batch
        of any of `widths` positions (gradient and recompute: none under `trainer.behaviour_logps =
        "sampler"`, which never recomputes) on dummy rows, so that a long sample arriving mid-run
        costs no compile. Params are not changed. Returns the lengths."""
        c, params = self._config, state.params
        shapes = self._micro_shapes(max_length, rows_per_update, widths)
        for T, R, chunk in shapes:
            if self._config.recomputes:
                tokens = np.zeros((chunk, T), np.int32)
                self._behaviour(
                    jax.device_put(tokens[None, None], self._rows_UMCT), np.full(chunk, version), params_of, chunk=chunk
                )
            zeros = lambda dtype, R=R, T=T: self._put(np.zeros((R, T), dtype))  # noqa: E731
            micro = dict(
                tokens=zeros(np.int32),
                mask=zeros(np.float32),
                inference=zeros(np.float32),
                behaviour=zeros(np.float32),
                adv=jax.device_put(np.zeros(R, np.float32), self._rows_C),
                current=jax.device_put(np.zeros(R, np.float32), self._rows_C),
            )
            (loss, _), grads = self._grad(params, micro, zeros(np.float32), ref_params, np.float32(1))
            jax.block_until_ready(grads)
        # The per-update programs: compiled ahead (not run: the update would donate the state).
        self._add.lower(grads, grads).compile()
        self._apply.lower(state, grads, loss).compile()
        if c.grad_ahead:  # the step's sum of its rows and the rows computed ahead
            self._add_scaled.lower(grads, grads, loss).compile()
            self._scaled.lower(grads, loss).compile()
        B = rows_per_update * c.num_updates
        self._advantages(np.zeros(B, np.float32), np.zeros(B, np.int32), np.zeros(B, np.float32))
        return [T for T, _, _ in shapes]

    def _micro_shapes(self, max_length: int, rows_per_update: int, widths) -> list[tuple[int, int, int]]:
        """(T, gradient rows, recompute rows) of every micro-batch a row of up to `max_length`
        positions can get in a batch of any of `widths` positions."""
        c, shapes = self._config, []
        for T in bucket_lengths(max_length, self._pad_to, widths):
            rows = functools.partial(
                micro_rows,
                T,
                micro_batch_size=c.micro_batch_size,
                token_budget=c.micro_batch_tokens,
                shards=self._shards,
            )
            shapes.append((T, rows(limit=rows_per_update), rows(limit=c.micro_batch_size)))
        return shapes

    def lower(
        self, state, ref_params, max_length: int, rows_per_update: int, widths=(None,)
    ) -> list[tuple[str, jax.stages.Lowered]]:
        """The programs `warmup` compiles, lowered on `state` (abstract values with shardings are
        enough: nothing runs), for ahead-of-time compilation: [(name, Lowered)]."""
        params = state.params
        abstract = lambda shape, dtype, sharding: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
        programs = []
        for T, R, chunk in self._micro_shapes(max_length, rows_per_update, widths):
            if self._config.recomputes:
                tokens = abstract((1, 1, chunk, T), jnp.int32, self._rows_UMCT)
                programs.append((f"recompute[rows={chunk},T={T}]", self._behaviour.lower(params, tokens, chunk=chunk)))
            zeros = lambda dtype, R=R, T=T: abstract((R, T), dtype, self._rows_CT)  # noqa: E731
            micro = dict(
                tokens=zeros(jnp.int32),
                mask=zeros(jnp.float32),
                inference=zeros(jnp.float32),
                behaviour=zeros(jnp.float32),
                adv=abstract((R,), jnp.float32, self._rows_C),
                current=abstract((R,), jnp.float32, self._rows_C),
            )
            count = abstract((), jnp.float32, self._replicated)
            lowered = self._grad.lower(params, micro, zeros(jnp.float32), ref_params, count)
            programs.append((f"grad[rows={R},T={T}]", lowered))
        grads = params  # the gradient function's outputs: the params' shapes, dtypes and shardings
        loss = abstract((), jnp.float32, self._replicated)
        programs.append(("grad_sum", self._add.lower(grads, grads)))
        if self._config.grad_ahead:  # the step's rows plus the scaled rows computed ahead
            programs.append(("grad_ahead_join", self._add_scaled.lower(grads, grads, loss)))
        programs.append(("optimizer_update", self._apply.lower(state, grads, loss)))
        return programs

    def _put(self, x_CT: np.ndarray) -> jax.Array:
        return jax.device_put(x_CT, self._rows_CT)


def _padded_rows(micro: Micro, x_B: np.ndarray) -> np.ndarray:
    """The micro-batch's rows of a [B] or [B, T] host array, cut to its length and padded with
    zero rows to its compiled size."""
    x = x_B[micro.rows] if x_B.ndim == 1 else x_B[micro.rows, : micro.length]
    if micro.rows.size == micro.size:
        return x
    return np.concatenate([x, np.zeros((micro.size - micro.rows.size,) + x.shape[1:], x.dtype)])
