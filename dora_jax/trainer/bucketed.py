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

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from dora_jax.records import TrainBatch
from dora_jax.trainer.batching import bucket_length
from dora_jax.trainer.loss import LossStats, token_weights
from dora_jax.trainer.step import StepOutputs, _micro_loss, apply_grads, batch_advantages


def row_lengths(batch: TrainBatch) -> np.ndarray:
    """Positions each row really uses: up to its last response token (1 for an empty row)."""
    mask = np.asarray(batch.loss_mask_BT) > 0
    last = mask.shape[1] - np.argmax(mask[:, ::-1], axis=1)
    return np.where(mask.any(1), last, 1)


def micro_plan(lengths_B: np.ndarray, num_updates: int, micro_batch_size: int, pad_to: int):
    """[[(rows_C, T_m), ...] per update]: each update's rows sorted longest first, cut into
    micro-batches of `micro_batch_size` rows, each with its own bucket length T_m."""
    B = lengths_B.shape[0]
    per_update = B // num_updates
    plan = []
    for u in range(num_updates):
        rows = np.arange(u * per_update, (u + 1) * per_update)
        rows = rows[np.argsort(-lengths_B[rows], kind="stable")]
        micros = []
        for start in range(0, per_update, micro_batch_size):
            part = rows[start : start + micro_batch_size]
            micros.append((part, bucket_length(int(lengths_B[part].max()), pad_to)))
        plan.append(micros)
    return plan


class BucketedStep:
    """Runs one batch as `step.train_step` would, micro-batch by micro-batch at their own lengths."""

    def __init__(self, graphdef, tx, config, mesh, batch_axes, param_shardings, state_shardings, replicated,
                 behaviour, *, pad_to: int, compiler_options=None, on_trace=lambda: None):
        self._config, self._pad_to, self._behaviour = config, pad_to, behaviour
        self._rows_CT = NamedSharding(mesh, PartitionSpec(batch_axes, None))
        self._rows_C = NamedSharding(mesh, PartitionSpec(batch_axes))
        self._rows_UMCT = NamedSharding(mesh, PartitionSpec(None, None, batch_axes, None))
        self._replicated = replicated
        loss_config = config.loss_config()

        def grad(params, micro, weights_CT, ref_params, micro_batches):
            on_trace()
            fn = functools.partial(_micro_loss, graphdef=graphdef, loss_config=loss_config,
                                   router_aux_coef=config.router_aux_coef, micro_batches=micro_batches)
            return jax.value_and_grad(fn, has_aux=True)(params, micro, weights_CT, ref_params)

        self._grad = jax.jit(grad, static_argnums=(4,), out_shardings=((replicated, replicated), param_shardings),
                             compiler_options=compiler_options)
        self._add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b), donate_argnums=(0,))
        self._apply = jax.jit(functools.partial(apply_grads, tx=tx), donate_argnums=(0,),
                              out_shardings=(state_shardings, replicated, replicated), compiler_options=compiler_options)
        self._advantages = jax.jit(functools.partial(batch_advantages, estimator=config.advantage,
                                                     dynamic_sampling=config.dynamic_sampling))
        self._weights = jax.jit(functools.partial(token_weights, loss_norm=loss_config.loss_norm, t_max=loss_config.t_max))

    def __call__(self, state, batch: TrainBatch, ref_params, params_of):
        c = self._config
        versions_B = np.asarray(batch.versions_B, np.int64)
        adv_B, valid_B, dropped = jax.device_get(self._advantages(
            np.asarray(batch.rewards_B, np.float32), np.asarray(batch.group_ids_B, np.int32),
            np.asarray(batch.valid_B, np.float32)))
        mask_BT = np.asarray(batch.loss_mask_BT, np.float32) * valid_B[:, None]
        plan = micro_plan(row_lengths(batch), c.num_updates, c.micro_batch_size, self._pad_to)
        per_update = batch.batch_size // c.num_updates
        tokens_BT = np.asarray(batch.tokens_BT, np.int32)
        inference_BT = np.asarray(batch.inference_logps_BT, np.float32)
        behaviour_BT = self._behaviour_logps(tokens_BT, versions_B, row_lengths(batch), params_of)
        losses, norms, finites, stats, load, aux = [], [], [], None, None, []
        for u, micros in enumerate(plan):
            rows_u = np.arange(u * per_update, (u + 1) * per_update)
            weights_BT = np.zeros_like(mask_BT)
            weights_BT[rows_u] = np.asarray(self._weights(mask_BT[rows_u]))  # over the whole mini-batch
            grads, loss, update_aux = None, 0.0, 0.0
            for rows, T in micros:
                micro = dict(
                    tokens=self._put(tokens_BT[rows, :T]), mask=self._put(mask_BT[rows, :T]),
                    inference=self._put(inference_BT[rows, :T]),
                    behaviour=self._put(behaviour_BT[rows, :T]), adv=jax.device_put(adv_B[rows], self._rows_C),
                )
                (micro_loss, (micro_stats, (micro_load, micro_aux))), micro_grads = self._grad(
                    state.params, micro, self._put(weights_BT[rows, :T]), ref_params, len(micros))
                grads = micro_grads if grads is None else self._add(grads, micro_grads)
                loss = loss + micro_loss
                update_aux = update_aux + micro_aux
                stats = micro_stats if stats is None else stats.merge(micro_stats)
                load = micro_load if load is None else load + micro_load
            state, grad_norm, finite = self._apply(state, grads, jnp.asarray(loss, jnp.float32))
            losses.append(loss)
            norms.append(grad_norm)
            finites.append(finite)
            aux.append(update_aux / len(micros))
        outputs = StepOutputs(
            loss=jnp.mean(jnp.stack(losses)), grad_norm=jnp.mean(jnp.stack(norms)),
            finite_U=jnp.stack(finites).astype(jnp.int32), dropped_groups=dropped, updates=state.updates,
            stats=stats if stats is not None else LossStats.empty(), router_load_LX=load,
            router_aux_loss=jnp.mean(jnp.stack(aux)),
        )
        return state, outputs

    def _behaviour_logps(self, tokens_BT, versions_B, lengths_B, params_of) -> np.ndarray:
        """[B, T] behaviour log-probs on the host, computed before any update (the updates donate
        the current params, the behaviour policy of the newest samples). Rows are grouped by
        version, then by length: one forward per C rows of one version, at that chunk's bucket."""
        C = self._config.micro_batch_size
        out = np.zeros(tokens_BT.shape, np.float32)
        for version in np.unique(versions_B):
            rows = np.flatnonzero(versions_B == version)
            rows = rows[np.argsort(-lengths_B[rows], kind="stable")]
            for start in range(0, rows.size, C):
                part = rows[start : start + C]
                T = bucket_length(int(lengths_B[part].max()), self._pad_to)
                padded = np.concatenate([part, np.full(C - part.size, part[0])])
                logps = self._behaviour(jax.device_put(tokens_BT[padded, :T][None, None], self._rows_UMCT),
                                        versions_B[padded], params_of)
                # The chunk's rows are sharded over the mesh, which may span several processes
                # (a multi-host trainer): each host gathers the whole chunk (in one process, this
                # is np.asarray).
                out[part, :T] = multihost_utils.process_allgather(logps, tiled=True)[0, 0, : part.size]
        return out

    def warmup(self, params, ref_params, version: int, max_length: int, rows_per_update: int, params_of) -> list[int]:
        """Compiles every bucket shape up to `max_length` (gradient and recompute) on dummy rows,
        so that a long sample arriving mid-run costs no compile. Params are not changed."""
        C = self._config.micro_batch_size
        lengths, T = [], self._pad_to
        while True:
            lengths.append(T)
            if T >= max_length:
                break
            T *= 2
        zeros = lambda T, dtype: self._put(np.zeros((C, T), dtype))  # noqa: E731
        for T in lengths:
            tokens = np.zeros((C, T), np.int32)
            self._behaviour(jax.device_put(tokens[None, None], self._rows_UMCT), np.full(C, version), params_of)
            micro = dict(tokens=zeros(T, np.int32), mask=zeros(T, np.float32), inference=zeros(T, np.float32),
                         behaviour=zeros(T, np.float32), adv=jax.device_put(np.zeros(C, np.float32), self._rows_C))
            jax.block_until_ready(self._grad(params, micro, zeros(T, np.float32), ref_params, rows_per_update // C))
        return lengths

    def _put(self, x_CT: np.ndarray) -> jax.Array:
        return jax.device_put(x_CT, self._rows_CT)
