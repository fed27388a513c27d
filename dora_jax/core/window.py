"""The version window (C3) as arithmetic, shared by the coordinator and everything that reasons
about staleness: a sample dispatched at version v may be trained on by trainer versions
v .. v + K, where K is the mode's bound."""

from __future__ import annotations

from collections.abc import Mapping

from dora_jax.core.modes import Mode, policy_for


def staleness_bound(mode: Mode | str, k_max: int) -> int:
    """K: the mode's promised bound (sync 0, one-step-off 1), else the configured `k_max`."""
    promised = policy_for(mode).max_staleness
    return k_max if promised is None else promised


def takes_for_newest(k: int, taken_at: int, latest: int) -> int:
    """How many trainer takes may still consume a sample of the newest version (trainer versions
    latest .. latest + K): K + 1 until the trainer has taken at `latest`, K after. Everything
    unconsumed is at most that new, so it must fit in these takes."""
    return k + (taken_at < latest)


def window_allows(rest_counts: Mapping[int, int], trainer_version: int, k_max: int, train_batch_size: int) -> bool:
    """Whether the trainer may advance from t to t+1, leaving `rest_counts` (samples per version)
    unconsumed.

    The window itself: nothing left below t+1-K. And, looking ahead, every later step can still
    keep it: after m more steps (m * TBS samples, oldest first) nothing may remain below
    t+1+m-K, so at most m * TBS of what is left may be older than that. Without the look-ahead
    the trainer could take newer samples while old ones are still decoding, and be stuck later
    with more old samples than one step can consume. Counts per version, not one entry per
    sample: at pod scale the rest is tens of thousands of samples over a handful of versions.
    """
    for m in range(k_max + 1):
        floor = trainer_version + 1 + m - k_max
        if sum(n for v, n in rest_counts.items() if v < floor) > m * train_batch_size:
            return False
    return True


def window_fits(unconsumed: Mapping[int, int], next_take: int, k_max: int, train_batch_size: int) -> bool:
    """Whether every sample not yet trained on (finished or still decoding), counted per version
    in `unconsumed`, can still be consumed within C3 by the takes from trainer version `next_take`
    on, oldest first: the take at `next_take + m` is the last that may consume versions below
    `next_take + m + 1 - K`, so at most (m + 1) x TBS samples may be that old (and none may be
    older than `next_take - K`, which no take can consume)."""
    if any(n > 0 and v < next_take - k_max for v, n in unconsumed.items()):
        return False
    for m in range(k_max + 1):
        floor = next_take + m + 1 - k_max
        if sum(n for v, n in unconsumed.items() if v < floor) > (m + 1) * train_batch_size:
            return False
    return True
