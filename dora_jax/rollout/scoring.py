"""Behaviour log-probs scored on the rollout slice (`trainer.behaviour_logps = "rollout"`).

Shape letters: N trajectories of one scoring call (a rows bucket), T positions (a length bucket).

The trainer needs, for every trained row, the per-token log-probs of its response under the exact
version that generated it. A rollout slice holds that version (C1: one slice serves one version),
so it can score a trajectory when it finishes, while the trainer's recompute would otherwise sit on
the training step's critical path. The scoring is the TRAINING forward, not the engine's decode-time
log-probs: `forward(graphdef, params, tokens_NT)` is the trainer's own `sequence_logps` (the runtime
passes it in, with the trainer's `vocab_chunk` and temperature: the rollout package does not import
the trainer), over the slice's params, which are the published version in the compute dtype, as the
trainer's recompute reads them.

The trajectories finished in one worker step are scored together, right-padded (the decoder is
causal: padding changes nothing before it) to a fixed bucket: rows a power of two up to
`max_rows` (more are cut into several calls), positions `min_length * 2^k`, capped at `max_length`
(the slice's cache length: no trajectory is longer, and its longest rows are then padded to it, not
to the next power of two, as the trainer caps its buckets at its batch width). So a run compiles at
most log2(max_rows) x (log2(longest / min_length) + 1) programs, never one per length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from dora_jax.parallel import sharding as sharding_lib

# (graphdef, params, tokens_NT) -> logps_NT: position t holds the log-prob of tokens_NT[:, t].
Forward = Callable[[Any, Any, jax.Array], jax.Array]


def bucket(size: int, low: int) -> int:
    """The smallest `low * 2^k` >= `size`."""
    out = max(1, low)
    while out < size:
        out *= 2
    return out


class TrajectoryScorer:
    """Scores (prompt, response) pairs with the training forward on one slice's mesh."""

    def __init__(
        self,
        forward: Forward,
        graphdef,
        param_shardings,
        mesh: Mesh,
        rules: sharding_lib.Rules,
        *,
        max_rows: int = 8,
        min_length: int = 16,
        max_length: int | None = None,
    ):
        """`forward`: the trainer's log-prob forward (see the module docstring); `param_shardings`:
        the slice's params as its engine places them; `max_rows`: rows per call at most (the
        worker passes its slot count: at most that many finish in one step); `max_length`: the
        widest bucket (the slice's cache length; None: powers of two without a cap)."""
        if max_rows < 1 or min_length < 1 or (max_length is not None and max_length < 1):
            raise ValueError(
                f"TrajectoryScorer: max_rows={max_rows}, min_length={min_length}, max_length={max_length}; "
                "expected >= 1 each"
            )
        self.max_rows, self.min_length, self.max_length = max_rows, min_length, max_length
        self.traces = 0  # programs traced so far (one per rows and length bucket)
        replicated = sharding_lib.replicated(mesh)

        def traced(params, tokens_NT):
            self.traces += 1
            with sharding_lib.activation_layout(mesh, rules):
                return forward(graphdef, params, tokens_NT)

        self._score = jax.jit(traced, in_shardings=(param_shardings, replicated), out_shardings=replicated)

    def shape(self, rows: int, length: int) -> tuple[int, int]:
        """The (N, T) bucket of a call over `rows` sequences of at most `length` positions."""
        T = bucket(length, self.min_length)
        if self.max_length is not None and length <= self.max_length:
            T = min(T, self.max_length)
        return bucket(min(rows, self.max_rows), 1), T

    def __call__(self, params, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[np.ndarray]:
        """For each (prompt_ids, response_ids): float32 log-probs of the response tokens under
        `params`, one per token. Prompts must not be empty (nothing predicts a first token)."""
        out: list[np.ndarray] = []
        for start in range(0, len(sequences), self.max_rows):
            part = sequences[start : start + self.max_rows]
            N, T = self.shape(len(part), max(len(p) + len(r) for p, r in part))
            tokens_NT = np.zeros((N, T), np.int32)
            for n, (prompt, response) in enumerate(part):
                if not prompt:
                    raise ValueError("TrajectoryScorer: a trajectory with an empty prompt; expected >= 1 prompt token")
                tokens_NT[n, : len(prompt) + len(response)] = np.concatenate([prompt, response])
            logps_NT = np.asarray(self._score(params, tokens_NT), np.float32)
            out += [logps_NT[n, len(p) : len(p) + len(r)].copy() for n, (p, r) in enumerate(part)]
        return out

    def lower(self, params, rows: int, length: int):
        """The scoring program of the (rows, length) bucket, lowered for `params` (arrays or their
        abstract shapes): what `tpu_compile` compiles for the rollout role."""
        N, T = self.shape(rows, length)
        return self._score.lower(params, jax.ShapeDtypeStruct((N, T), np.int32))

    def warmup(self, params, max_length: int) -> int:
        """Compiles every bucket a trajectory of up to `max_length` positions can get; returns how
        many programs that is."""
        shapes = set()
        rows = 1
        while True:
            length = self.min_length
            while True:
                shapes.add(self.shape(rows, min(length, max_length)))
                if length >= max_length:
                    break
                length *= 2
            if rows >= self.max_rows:
                break
            rows *= 2
        for N, T in sorted(shapes):
            jax.block_until_ready(self._score(params, np.zeros((N, T), np.int32)))
        return len(shapes)
