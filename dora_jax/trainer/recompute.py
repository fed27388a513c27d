"""Behaviour log-probs recomputed by the trainer, each sample with its own generating version.

Shape letters: B samples, T positions, C chunk rows; U, M, C also name the trainer's layout of a
batch as [updates, micro-batches, micro-batch rows] (B = U * M * C, row b at its C-order index).

A batch mixes versions w_1..w_k. For each version the rows it generated are cut into chunks of C
rows (the last one padded with a repeat of a row of the same version, whose result is dropped),
the version's params are fetched once (from the ParamStore, in the trainer's shardings, or the
trainer's own live params for its current version) and one jitted call per chunk runs the forward
and scatters the log-probs into a [B, T] buffer that stays on device. Every call has the same
shapes whatever the version mix, so nothing recompiles; the cost is B + (k - 1) * C rows of
forward at most, instead of k * B for "whole batch per version, then select rows".
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dora_jax.trainer.loss import LossConfig
from dora_jax.trainer.step import sequence_logps


def _fill_chunk(params, out_UMCT, tokens_UMCT, src_C3, dst_C3, *, graphdef, vocab_chunk: int, temperature: float = 1.0):
    """Forward of the C rows at (u, m, c) = src_C3 and write their log-probs (at `temperature`) at dst_C3."""
    rows_CT = tokens_UMCT[src_C3[:, 0], src_C3[:, 1], src_C3[:, 2]]
    logps_CT, _ = sequence_logps(graphdef, params, rows_CT, vocab_chunk, temperature=temperature)
    # Padding rows point at u = U, out of range: dropped.
    return out_UMCT.at[dst_C3[:, 0], dst_C3[:, 1], dst_C3[:, 2]].set(logps_CT, mode="drop")


def chunk_plan(versions_B: np.ndarray, chunk: int, skip_B=None) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """[(version, src_C, dst_C)]: flat rows to read and to write for each chunk, oldest version first;
    rows where `skip_B` is true are left out (their log-probs come from elsewhere).

    Padding entries read a row of the same version and write to row B (out of range).
    """
    versions_B = np.asarray(versions_B)
    B = versions_B.shape[0]
    wanted_B = np.ones(B, bool) if skip_B is None else ~np.asarray(skip_B, bool)
    plan = []
    for version in np.unique(versions_B[wanted_B]):
        rows = np.flatnonzero((versions_B == version) & wanted_B)
        for start in range(0, rows.size, chunk):
            part = rows[start : start + chunk]
            pad = chunk - part.size
            src = np.concatenate([part, np.full(pad, part[0])]).astype(np.int32)
            dst = np.concatenate([part, np.full(pad, B)]).astype(np.int32)
            plan.append((int(version), src, dst))
    return plan


def _unravel(rows_C: np.ndarray, lead: tuple[int, int, int]) -> np.ndarray:
    """Flat rows -> [C, 3] (u, m, c) indices; row B (padding) -> u = U, out of range."""
    pad = rows_C >= np.prod(lead)
    index_C3 = np.stack(np.unravel_index(np.where(pad, 0, rows_C), lead), -1).astype(np.int32)
    index_C3[pad, 0] = lead[0]
    return index_C3


class BehaviourLogps:
    """Computes behaviour log-probs per version group with one compiled chunk function, at the
    rollout's sampling `temperature` (softmax of logits / temperature, as the loss's)."""

    def __init__(
        self,
        graphdef,
        param_shardings,
        rows_sharding,
        replicated,
        chunk: int,
        on_trace: Callable[[], None],
        compiler_options=None,
        layout: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        temperature: float = 1.0,
        vocab_chunk: int = LossConfig.vocab_chunk,  # the vocabulary slice width (trainer.vocab_chunk)
    ):
        self._chunk = chunk
        self._rows_sharding = rows_sharding  # the sharding of a [U, M, C, T] array
        self._replicated = replicated

        def traced(*args, **kwargs):
            on_trace()
            with layout():
                return _fill_chunk(*args, **kwargs)

        self._fill = jax.jit(
            functools.partial(traced, graphdef=graphdef, temperature=temperature, vocab_chunk=vocab_chunk),
            in_shardings=(param_shardings, rows_sharding, rows_sharding, replicated, replicated),
            out_shardings=rows_sharding,
            donate_argnums=(1,),
            compiler_options=compiler_options,
        )

    def __call__(
        self,
        tokens_UMCT: jax.Array,
        versions_B: np.ndarray,
        params_of: Callable[[int], Any],
        chunk: int | None = None,
        skip_B=None,
        initial_UMCT: jax.Array | None = None,
    ) -> jax.Array:
        """logps_UMCT on device; `params_of(version)` returns that version in the trainer's shardings.
        `chunk` overrides the rows per forward (one compile per chunk and length); rows where
        `skip_B` is true are not computed: they keep `initial_UMCT` (log-probs that came with the
        batch, in the rows sharding; donated), or 0."""
        lead = tokens_UMCT.shape[:3]
        out_UMCT = initial_UMCT
        if out_UMCT is None:
            out_UMCT = jnp.zeros(tokens_UMCT.shape, jnp.float32, device=self._rows_sharding)
        current, params = None, None
        for version, src_C, dst_C in chunk_plan(versions_B, chunk or self._chunk, skip_B):
            if version != current:
                current, params = version, params_of(version)
            out_UMCT = self._fill(params, out_UMCT, tokens_UMCT, _unravel(src_C, lead), _unravel(dst_C, lead))
        return out_UMCT

    def lower(self, params, tokens_UMCT, chunk: int | None = None) -> jax.stages.Lowered:
        """The chunk program lowered for token buffers shaped like `tokens_UMCT` (abstract values
        with shardings are enough: nothing runs), for ahead-of-time compilation."""
        out_UMCT = jax.ShapeDtypeStruct(tokens_UMCT.shape, jnp.float32, sharding=self._rows_sharding)
        index_C3 = jax.ShapeDtypeStruct((chunk or self._chunk, 3), jnp.int32, sharding=self._replicated)
        return self._fill.lower(params, out_UMCT, tokens_UMCT, index_C3, index_C3)
