"""The modelled workload: B prompts x G samples per step with long-tailed response lengths.

Response lengths are log-normal, log L = mu + sigma * (sqrt(rho) z_prompt + sqrt(1 - rho) z_sample),
so the G samples of one prompt are correlated (hard prompts give long answers), clipped to
[1, max_response]. mu = log(median); sigma is chosen so that the expected maximum of one training
batch (B x G draws) is `max_over_median` times the median: sigma = log(ratio) / z_n with z_n the
standard-normal quantile at 1 - 1/n. The stream is deterministic: prompt p gets the same lengths
in every mode, because every mode consumes prompts in order and blocks are drawn in order.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from typing import Protocol

import numpy as np

_BLOCK_PROMPTS = 256


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    prompts_per_step: int = 512  # B: prompts per training batch
    samples_per_prompt: int = 16  # G: responses per prompt (one GRPO group)
    prompt_tokens: int = 2048  # every prompt's length
    median_response: float = 2400.0
    max_response: int = 30720  # generation cap (max_new_tokens)
    max_over_median: float = 12.0  # expected longest response of one batch / median
    prompt_correlation: float = 0.5  # rho: share of log-length variance shared by a prompt's G samples
    seed: int = 0

    def __post_init__(self):
        if self.prompts_per_step < 1 or self.samples_per_prompt < 1:
            raise ValueError("prompts_per_step and samples_per_prompt must be >= 1")
        if not 0.0 <= self.prompt_correlation <= 1.0:
            raise ValueError(f"prompt_correlation must be in [0, 1], got {self.prompt_correlation}")
        if self.max_over_median <= 1.0:
            raise ValueError(f"max_over_median must be > 1, got {self.max_over_median}")

    @property
    def batch_samples(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def sigma(self) -> float:
        n = max(self.batch_samples, 4)  # tiny batches: keep z_n away from 0
        z_n = statistics.NormalDist().inv_cdf(1.0 - 1.0 / n)
        return math.log(self.max_over_median) / z_n


def draw_lengths(spec: WorkloadSpec, rng: np.random.Generator, prompts: int) -> np.ndarray:
    """Response lengths, shape (prompts, G), int64 in [1, max_response]."""
    g = spec.samples_per_prompt
    rho = spec.prompt_correlation
    z_prompt = rng.standard_normal((prompts, 1))
    z_sample = rng.standard_normal((prompts, g))
    z = math.sqrt(rho) * z_prompt + math.sqrt(1.0 - rho) * z_sample
    lengths = np.exp(math.log(spec.median_response) + spec.sigma * z)
    return np.clip(np.rint(lengths), 1, spec.max_response).astype(np.int64)


class LengthSource(Protocol):
    """Where the simulator gets each prompt's G response lengths, in dispatch order."""

    def next_prompt(self) -> list[int]: ...


class CyclicLengths:
    """Fixed lengths, prompt after prompt, repeating: for hand-checkable workloads."""

    def __init__(self, prompts: list[list[int]]):
        self._prompts, self._next = [list(p) for p in prompts], 0

    def next_prompt(self) -> list[int]:
        row = self._prompts[self._next % len(self._prompts)]
        self._next += 1
        return list(row)


class LengthStream:
    """Prompt-by-prompt response lengths, identical across modes for one spec."""

    def __init__(self, spec: WorkloadSpec):
        self._spec = spec
        self._rng = np.random.default_rng(spec.seed)
        self._block = np.zeros((0, spec.samples_per_prompt), dtype=np.int64)
        self._next = 0

    def next_prompt(self) -> list[int]:
        if self._next == len(self._block):
            self._block = draw_lengths(self._spec, self._rng, _BLOCK_PROMPTS)
            self._next = 0
        row = self._block[self._next]
        self._next += 1
        return row.tolist()


@functools.lru_cache(maxsize=64)
def mean_response(spec: WorkloadSpec, draws: int = 200_000) -> float:
    """Monte-Carlo mean response length (used to size placements), from its own fixed stream."""
    prompts = max(1, draws // spec.samples_per_prompt)
    return float(draw_lengths(spec, np.random.default_rng(12345), prompts).mean())
