"""Legacy fill: new groups at an older version, on that version's slices, in slots that would idle.

The orchestrator moves requests between slices of one version and switches emptied slices to the
newest version, but a version's last slice stays until its last long samples finish (C1), with
its other slots empty. The paper's fill step gives such residual free slots "just enough work to
keep devices busy": new groups dispatched at that older version v. Such a group is only worth
starting if the trainer can still consume it within C3, i.e. by its take at version v + K, and if
the version window can absorb its samples; otherwise it would make the trainer wait (or be
unconsumable). Both are checked here, from what the coordinator observes (how long groups ran:
their samples' decode time as the workers measured it, admission to finish, so that queueing
behind a full slice does not count, as a legacy group starts at once; how long a training step
takes), never from known lengths:

  deadline(v) = last publish + (v + K - latest) x step time    (when the take at v + K is due)
  start a group at v only if  now + longest group time <= deadline(v)
                        and   the window still fits (`core.window.window_fits`) with it added.

The longest group time is the longest of the recently completed groups (a migrated sample counts
from its group's dispatch, an upper bound) and of the legacy groups still running (their age so
far: they started at dispatch), so a slow legacy tail raises it before it finishes. As v + K
nears, the deadline closes and filling stops by itself.

`candidates` and `movable_groups` pick, from the orchestrator's views and the backlog, the slices a
fill may use and the unsent groups it may move there; `plan` decides how many groups each takes.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Container, Mapping, Sequence

from dora_jax.coordinator import orchestrator
from dora_jax.core.records import Request
from dora_jax.core.window import window_fits


class Pace:
    """Observed timing: durations of completed groups and the times of recent publishes."""

    def __init__(self, recent_groups: int = 64, recent_steps: int = 4):
        self._durations: collections.deque[float] = collections.deque(maxlen=recent_groups)
        self._publishes: collections.deque[float] = collections.deque(maxlen=recent_steps + 1)

    def group_done(self, seconds: float) -> None:
        self._durations.append(seconds)

    def published(self, t: float) -> None:
        self._publishes.append(t)

    @property
    def last_publish(self) -> float | None:
        return self._publishes[-1] if self._publishes else None

    def step_s(self) -> float | None:
        """Mean interval between the recent publishes (None before two were seen)."""
        if len(self._publishes) < 2:
            return None
        return (self._publishes[-1] - self._publishes[0]) / (len(self._publishes) - 1)

    def longest_group_s(self, running_ages: Sequence[float]) -> float | None:
        """The longest recent group, counting running groups' ages (None before one completed)."""
        if not self._durations:
            return None
        return max(max(self._durations), max(running_ages, default=0.0))


@dataclasses.dataclass(frozen=True)
class OldSlice:
    slice_id: int
    version: int
    free: int  # slots with nothing admitted or queued


def candidates(
    views: Sequence[orchestrator.SliceView],
    latest: int,
    unsent_latest: int,
    group_size: int,
    failing: Container[int],
) -> tuple[list[OldSlice], int]:
    """The old-version slices a fill may use, and the free slots the newest version will have.

    A slice qualifies with a group's worth of free slots, and only where the orchestrator keeps its
    version at its number of slices (filling a slice it would empty would hold it). `unsent_latest`
    counts the newest version's requests not yet on a slice, which the orchestrator places next.
    """
    loads: collections.Counter[int] = collections.Counter({latest: unsent_latest})
    newest_free, old = 0, {}
    for view in views:
        if view.version is not None:
            loads[view.version] += len(view.trajs)
        if view.version == latest:
            newest_free += max(view.free, 0)
        elif not view.trajs:
            newest_free += view.num_slots  # the orchestrator switches it to the newest version
        elif view.version is not None and view.free >= group_size and view.slice_id not in failing:
            old.setdefault(view.version, []).append(view)
    targets = orchestrator.target_partition(loads, len(views), latest)
    slices = [
        OldSlice(v.slice_id, v.version, v.free)
        for version, members in old.items()
        if len(members) <= targets.get(version, 0)
        for v in members
    ]
    return slices, newest_free


def movable_groups(
    backlog: Mapping[str, Request], unsent: Container[str], newest_free: int, group_size: int
) -> list[tuple[str, list[str]]]:
    """Whole groups of `backlog` (none of their requests ever sent) that a fill may move to an old
    version, with their request ids in order: as many, first ones first, as the newest version's
    `newest_free` slots leave without a slot (they would queue there)."""
    ids_of: dict[str, list[str]] = {}
    for traj_id, request in backlog.items():
        if request.group_id in unsent:
            ids_of.setdefault(request.group_id, []).append(traj_id)
    return list(ids_of.items())[: max(len(backlog) - newest_free, 0) // group_size]


def plan(
    slices: Sequence[OldSlice],
    *,
    latest: int,
    next_take: int,
    k: int,
    train_batch_size: int,
    group_size: int,
    unconsumed: Mapping[int, int],
    now: float,
    pace: Pace,
    running_ages: Sequence[float],
    movable_groups: int = 0,
) -> list[tuple[int, int]]:
    """(slice id, number of groups to start at the slice's version), oldest version first.

    `unconsumed` counts every sample not yet trained on (finished or still decoding) per version;
    `next_take` is the trainer version of the next take. The first `movable_groups` groups filled
    are unsent groups of the newest version moved down (their samples leave `latest`'s count),
    the rest are new.
    """
    step_s, longest = pace.step_s(), pace.longest_group_s(running_ages)
    if step_s is None or longest is None or pace.last_publish is None:
        return []  # nothing observed yet: no basis for a deadline
    counts = collections.Counter(unconsumed)
    out = []
    for s in sorted(slices, key=lambda s: (s.version, s.slice_id)):
        steps_left = s.version + k - latest
        if steps_left < 1 or now + longest > pace.last_publish + steps_left * step_s:
            continue
        groups = 0
        for _ in range(s.free // group_size):
            moved = group_size if movable_groups > 0 else 0
            counts[s.version] += group_size
            counts[latest] -= moved
            if not window_fits(counts, next_take, k, train_batch_size):
                counts[s.version] -= group_size
                counts[latest] += moved
                break
            movable_groups -= bool(moved)
            groups += 1
        if groups:
            out.append((s.slice_id, groups))
    return out
