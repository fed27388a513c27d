"""What arrives in the coordinator's inbox: one small frozen record per kind of event.

Worker threads, reward callbacks, the trainer and the transport only post these (posting never
blocks); the coordinator's loop applies them in order in `Coordinator._handle`, the one place
that dispatches on their type.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from dora_jax.core.records import Trajectory


@dataclasses.dataclass(frozen=True)
class Finished:
    """A slice finished these trajectories (posted before it answers its next command)."""

    slice_id: int
    trajectories: tuple[Trajectory, ...]


@dataclasses.dataclass(frozen=True)
class Scored:
    """A reward came back (or failed: `error` says why, and the sample is masked)."""

    trajectory: Trajectory
    reward: float
    error: str | None


@dataclasses.dataclass(frozen=True)
class Published:
    """The trainer stored a new version."""

    version: int


@dataclasses.dataclass(frozen=True)
class Taken:
    """The trainer took a batch at `trainer_version`: what follows a take (supply, switching)
    runs on the coordinator's loop, never on the trainer's thread."""

    trainer_version: int


@dataclasses.dataclass(frozen=True)
class SliceFailed:
    """A slice died (raised, missed heartbeats, process gone)."""

    slice_id: int
    reason: str


@dataclasses.dataclass(frozen=True)
class SliceWontRejoin:
    """A dropped slice whose restart was promised will not join after all (its supervisor gave up)."""

    slice_id: int
    reason: str


@dataclasses.dataclass(frozen=True)
class SliceJoined:
    """A (re)started slice joins with nothing loaded."""

    port: Any  # a RolloutPort


@dataclasses.dataclass(frozen=True)
class SnapshotRequested:
    """Another thread wants `snapshot()`: it reads the ports' progress, so the loop takes it."""

    extra: Callable[[], dict] | None
    result: Future[dict]


@dataclasses.dataclass(frozen=True)
class EvalRequested:
    """Evaluate `version` on held-out prompts (dora_jax.coordinator.evaluation); `result`
    resolves to the round's summary once every response is scored."""

    version: int
    step: int
    prompts: tuple[tuple[str, tuple[int, ...]], ...]
    samples: int
    result: Future[dict]


@dataclasses.dataclass(frozen=True)
class CallDone:
    """A slice command run off the loop thread has returned (dora_jax.coordinator.port_calls);
    `token` is that call's own, compared by identity."""

    token: object


Event = (
    Finished
    | Scored
    | Published
    | Taken
    | SliceFailed
    | SliceWontRejoin
    | SliceJoined
    | SnapshotRequested
    | EvalRequested
    | CallDone
)
