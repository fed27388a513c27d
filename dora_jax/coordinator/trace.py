"""The trace-driven workload of `bench modes`: forced response lengths and constant rewards.

Light on purpose (no JAX): the coordinator role imports it for `serve_coordinator --trace_lengths`."""

from __future__ import annotations

import dataclasses
import zlib
from concurrent.futures import Future

import numpy as np


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
    """Log-normal response lengths (median, sigma), capped at `max_len`. What matters is the skew
    inside one training batch: calibrate sigma so sync's bubble ratio lands in the paper's 74-88%."""

    median: float
    sigma: float
    max_len: int

    def draw(self, prompt_id: str, sample: int, seed: int) -> int:
        rng = np.random.default_rng([seed, zlib.crc32(prompt_id.encode()), sample])
        return int(np.clip(round(rng.lognormal(np.log(self.median), self.sigma)), 1, self.max_len))

    @classmethod
    def of(cls, cfg_dict) -> LengthDistribution:
        """From a config's `bench` section (configs/bench_longtail.py); a clear error without one."""
        bench = cfg_dict.get("bench") if hasattr(cfg_dict, "get") else None
        missing = [k for k in ("median_len", "sigma", "max_len") if not bench or k not in bench]
        if missing:
            raise ValueError(
                f"forced lengths need config.bench.{{median_len, sigma, max_len}}; missing {missing} "
                "(see configs/bench_longtail.py)"
            )
        return cls(float(bench["median_len"]), float(bench["sigma"]), int(bench["max_len"]))


class ConstantScorer:
    """Trace-driven runs measure the system, not learning: every sample scores 0."""

    def submit(self, trajectory) -> Future:
        future: Future = Future()
        future.set_result((0.0, None))
        return future

    def close(self) -> None:
        pass
