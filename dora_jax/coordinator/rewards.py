"""Rewards off the critical path: the RewardScorer seam and the trajectories awaiting a reward.

A finished trajectory goes to the scorer, whose future posts a `Scored` event back to the
coordinator's inbox when it resolves; a request refused at admission is scored 0 at once, and a
scorer that fails masks its sample instead of ending the run.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

from dora_jax.coordinator import events
from dora_jax.core.records import FinishReason, Trajectory


class RewardScorer(Protocol):
    def submit(self, trajectory: Trajectory) -> Future[tuple[float, str | None]]:
        """Scores off the critical path; resolves to (reward, error or None)."""


class Rewards:
    """The trajectories awaiting a reward, and their submission to the scorer."""

    def __init__(self, scorer: RewardScorer, post: Callable[[events.Scored], None]):
        self._scorer = scorer
        self._post = post  # into the coordinator's inbox (never blocks)
        self.unscored: dict[str, Trajectory] = {}  # finished, reward not back yet

    def submit(self, traj: Trajectory) -> None:
        self.unscored[traj.traj_id] = traj
        if traj.finish_reason == FinishReason.REJECTED:
            self._post(events.Scored(traj, 0.0, f"rejected: {traj.error}"))
            return
        future = self._scorer.submit(traj)
        future.add_done_callback(lambda f, t=traj: self._post(events.Scored(t, *_result(f))))

    def received(self, traj: Trajectory) -> None:
        """Its `Scored` event is being applied: it awaits a reward no more."""
        if self.unscored.pop(traj.traj_id, None) is None:
            raise RuntimeError(f"{traj.traj_id} scored but not awaiting a reward")


def _result(future: Future) -> tuple[float, str | None]:
    try:
        reward, error = future.result()
    except Exception as err:  # the scorer itself failed: mask the sample, keep the run
        return 0.0, f"scorer error: {type(err).__name__}: {err}"
    return reward, error
