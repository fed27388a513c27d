"""The coordinator's checkpoint as JSON: what `Coordinator.snapshot` returns and `restore` reads.

Pure functions over records. The coordinator gathers a `Saved` under its lock (with the ports'
progress, so that in-flight requests carry their tokens so far) and applies the one `from_json`
gives back; it writes the ledger's `resume` event itself. Finished groups, partly scored groups and
trajectories awaiting a reward are kept whole; evaluation requests are never in it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Mapping, Sequence

from dora_jax.coordinator.groups import GroupState
from dora_jax.coordinator.stats import CoordinatorStats
from dora_jax.core import records
from dora_jax.core.records import Group, Request, Trajectory


@dataclasses.dataclass(frozen=True)
class Saved:
    latest: int
    next_group: int
    next_eval: int  # round ids stay unique across a resume
    dispatched: Sequence[Request]  # in flight, with their tokens so far as a prefix
    backlog: Sequence[Request]
    redispatch: Sequence[str]  # backlog ids that were dispatched before
    groups: Mapping[str, GroupState]  # of each, only the version, size and scored samples are kept
    unscored: Sequence[Trajectory]
    queue: Sequence[Group]  # oldest first
    stats: CoordinatorStats
    ledger_offset: int
    extra: dict  # the caller's own (the prompt source's position)
    filtered_since_take: int = 0  # dynamic sampling: groups filtered since the trainer's last take


def with_progress(
    requests: Mapping[str, Request], progress: Mapping[str, Request], skip: Container[str]
) -> list[Request]:
    """The in-flight requests not in `skip`, each as the ports' `progress` has it (its tokens so
    far as a prefix) where that is still of the request's own version."""
    return [
        progress.get(t, r) if progress.get(t, r).version == r.version else r
        for t, r in requests.items()
        if t not in skip
    ]


def to_json(saved: Saved) -> dict:
    return {
        "latest": saved.latest,
        "next_group": saved.next_group,
        "next_eval": saved.next_eval,
        "dispatched": [records.request_to_json(r) for r in saved.dispatched],
        "backlog": [records.request_to_json(r) for r in saved.backlog],
        "redispatch": list(saved.redispatch),
        "groups": {
            gid: {
                "version": g.version,
                "size": g.size,
                "scored": [records.scored_to_json(x) for x in g.scored.values()],
            }
            for gid, g in saved.groups.items()
        },
        "unscored": [records.trajectory_to_json(t) for t in saved.unscored],
        "queue": [records.group_to_json(g) for g in saved.queue],
        "stats": dataclasses.asdict(saved.stats),
        "ledger_offset": saved.ledger_offset,
        "extra": saved.extra,
        "filtered_since_take": saved.filtered_since_take,
    }


def from_json(state: dict) -> Saved:
    groups = {}
    for gid, g in state["groups"].items():
        scored = [records.scored_from_json(x) for x in g["scored"]]
        groups[gid] = GroupState(int(g["version"]), int(g["size"]), {x.trajectory.traj_id: x for x in scored})
    return Saved(
        latest=int(state["latest"]),
        next_group=int(state["next_group"]),
        next_eval=int(state.get("next_eval", 0)),  # absent from checkpoints older than saved round ids
        dispatched=[records.request_from_json(r) for r in state["dispatched"]],
        backlog=[records.request_from_json(r) for r in state["backlog"]],
        redispatch=list(state["redispatch"]),
        groups=groups,
        unscored=[records.trajectory_from_json(t) for t in state["unscored"]],
        queue=[records.group_from_json(g) for g in state["queue"]],
        stats=CoordinatorStats(**state["stats"]),
        ledger_offset=int(state["ledger_offset"]),
        extra=state.get("extra", {}),  # the caller's own: `restore` does not read it
        filtered_since_take=int(state.get("filtered_since_take", 0)),  # absent before dynamic sampling filtered
    )
