"""The four rollout/training paradigms, as policies over the same parts.

| mode            | dispatch trigger                  | on publish                              | C1 | staleness |
|-----------------|-----------------------------------|-----------------------------------------|----|-----------|
| sync            | nothing unconsumed: one batch     | idle slices load the new version        | ok | 0         |
| one_step_off    | trainer took a batch: next batch  | idle slices load the new version        | ok | <= 1      |
| partial_rollout | keep RBS unconsumed               | interrupt all, reload, re-prefill       | NO | <= K      |
| dora            | keep RBS unconsumed               | orchestrator: repartition + migrate KV  | ok | <= K      |
"""

from __future__ import annotations

import dataclasses
import enum


class Mode(str, enum.Enum):
    SYNC = "sync"
    ONE_STEP_OFF = "one_step_off"
    PARTIAL_ROLLOUT = "partial_rollout"
    DORA = "dora"


class Supply(str, enum.Enum):
    """When new prompts are dispatched."""

    BARRIER = "barrier"  # a whole batch once nothing is unconsumed
    ONE_AHEAD = "one_ahead"  # a whole batch once at most one batch is unconsumed
    STREAM = "stream"  # top up to rollout_batch_size unconsumed samples


class Switch(str, enum.Enum):
    """How slices move to a newly published version."""

    WHEN_IDLE = "when_idle"  # a slice changes version only with no request on it
    INTERRUPT = "interrupt"  # every in-flight request is re-prefilled on the new version
    ORCHESTRATE = "orchestrate"  # DORA: repartition by load, migrate requests with their KV


@dataclasses.dataclass(frozen=True)
class ModePolicy:
    mode: Mode
    supply: Supply
    switch: Switch
    keeps_c1: bool
    max_staleness: int | None  # None: bounded by k_max


def policy_for(mode: Mode | str) -> ModePolicy:
    """The one factory from mode name to policy."""
    mode = Mode(mode)
    match mode:
        case Mode.SYNC:
            return ModePolicy(mode, Supply.BARRIER, Switch.WHEN_IDLE, keeps_c1=True, max_staleness=0)
        case Mode.ONE_STEP_OFF:
            return ModePolicy(mode, Supply.ONE_AHEAD, Switch.WHEN_IDLE, keeps_c1=True, max_staleness=1)
        case Mode.PARTIAL_ROLLOUT:
            return ModePolicy(mode, Supply.STREAM, Switch.INTERRUPT, keeps_c1=False, max_staleness=None)
        case Mode.DORA:
            return ModePolicy(mode, Supply.STREAM, Switch.ORCHESTRATE, keeps_c1=True, max_staleness=None)
