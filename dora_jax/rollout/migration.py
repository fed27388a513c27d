"""How an in-flight request moves between slices: its KV rows, or a re-prefill at the destination.

A migrated request continues under its own version either way (C1); sampling is counter-based
per position, so both ways give the same tokens. What differs is the cost:
- moving the KV: the rows' bytes over the link between the slices, plus a fixed latency per move
  (a connection's round trip and the source's read);
- re-prefilling: the destination prefills prompt + tokens so far in chunks of at most
  `max_prefill_length`, each padded to its bucket, with its slot's decoding interrupted as long.

`MigrationCosts.choose` takes the cheaper. Prefill times are measured per bucket by the engine's
warmup (`RolloutEngine.prefill_seconds`); the link starts from the config
(`rollout.kv_link_bytes_per_s`, no latency) and, once this slice has imported KV rows, is fitted
to its own last moves: seconds = latency + bytes / rate over moves of different sizes (small moves
are latency-bound: their bytes / seconds alone would understate the rate a large slot moves at),
bytes / seconds while every move had one size. The fit is robust (Theil-Sen: the median of the
pairwise slopes, the median intercept; medians for one size), because one move that stalled (the
source busy restoring a version from the tier, measured: 0.81 s for 32 KiB among moves of 1-5 ms)
made the least-squares fit price every move at ~1 s; the rule then re-prefilled every request, so
no move ever came to correct it. Moves whose time does not grow with their size (a non-positive
slope) are taken as latency-bound: their median time. Without a measured prefill
time the rule moves the KV (it cannot show that re-prefill is cheaper). `policy` "kv" / "reprefill"
force one way (a request whose prefix is too long to re-prefill always moves its KV).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

KV = "kv"
REPREFILL = "reprefill"
AUTO = "auto"
POLICIES = (AUTO, KV, REPREFILL)


@dataclasses.dataclass
class MigrationCosts:
    """The measured costs behind `choose` (mutable: `observe_link` updates the link's rate)."""

    policy: str = AUTO
    link_bytes_per_s: float = 0.0  # 0: unknown until an import is measured (then KV always)
    link_latency_s: float = 0.0
    prefill_seconds: dict[int, float] = dataclasses.field(default_factory=dict)  # bucket -> s
    moves: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=32))

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"rollout.migration={self.policy!r}; expected one of {POLICIES}")
        if self.link_bytes_per_s < 0:
            raise ValueError(f"rollout.kv_link_bytes_per_s={self.link_bytes_per_s}; expected >= 0")

    def kv_s(self, num_bytes: int) -> float | None:
        """Seconds to move `num_bytes` of KV, or None while the link's rate is unknown."""
        if not self.link_bytes_per_s:
            return None
        return self.link_latency_s + num_bytes / self.link_bytes_per_s

    def reprefill_s(self, buckets: Sequence[int]) -> float | None:
        """Seconds to prefill chunks padded to `buckets` (one measured prefill each: a later chunk's
        attention over the earlier ones is not counted), or None when one was not measured."""
        if any(b not in self.prefill_seconds for b in buckets):
            return None
        return sum(self.prefill_seconds[b] for b in buckets)

    def choose(self, num_bytes: int, buckets: Sequence[int]) -> str:
        """KV or REPREFILL for a request whose KV rows are `num_bytes` and whose re-prefill runs
        chunks padded to `buckets`."""
        if self.policy != AUTO:
            return self.policy
        kv, prefill = self.kv_s(num_bytes), self.reprefill_s(buckets)
        return REPREFILL if kv is not None and prefill is not None and prefill < kv else KV

    def observe_link(self, num_bytes: int, seconds: float) -> None:
        """One measured KV move (`moves` keeps the last 32): the link's latency and rate are fitted
        to them (see the module docstring)."""
        if num_bytes <= 0 or seconds <= 0:
            return
        self.moves.append((float(num_bytes), float(seconds)))
        sizes, times = np.array(self.moves).T
        i, j = np.triu_indices(len(sizes), k=1)
        apart = sizes[i] != sizes[j]
        if not apart.any():  # one size: its rate
            self.link_bytes_per_s, self.link_latency_s = float(np.median(sizes / times)), 0.0
            return
        slope = float(np.median((times[j] - times[i])[apart] / (sizes[j] - sizes[i])[apart]))
        if slope > 0:
            self.link_bytes_per_s = 1.0 / slope
            self.link_latency_s = max(float(np.median(times - slope * sizes)), 0.0)
        else:  # time does not grow with size: latency-bound
            self.link_bytes_per_s, self.link_latency_s = float("inf"), float(np.median(times))
