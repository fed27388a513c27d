"""Training groups: a prompt's G samples, from their requests until every one is scored and the
group enters the TransferQueue whole (its samples stay unconsumed until the trainer takes it).

`Groups` keeps the groups in flight for the coordinator, which dispatches their requests.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence, Set

from dora_jax.coordinator.config import CoordinatorConfig
from dora_jax.coordinator.legacy_fill import Pace
from dora_jax.core.records import Group, Request, ScoredTrajectory, Trajectory, request_sampling


@dataclasses.dataclass
class GroupState:
    version: int
    size: int
    scored: dict = dataclasses.field(default_factory=dict)
    dispatched_at: float | None = None  # clock at its first dispatch (for legacy fill's pace)
    longest_s: float = 0.0  # the longest run time of its finished samples (legacy fill's pace)
    legacy: bool = False  # started at an older version by legacy fill


def make_requests(
    group_id: str,
    prompt_id: str,
    prompt_ids: Sequence[int],
    version: int,
    config: CoordinatorConfig,
    forced_length: Callable[[str, int], int | None] | None,
) -> list[Request]:
    """The group's G requests, sample i as trajectory <group>/i at the run's sampling settings."""
    requests = []
    for i in range(config.group_size):
        traj_id = f"{group_id}/{i}"
        sampling = request_sampling(config.sampling, config.seed, traj_id)
        forced = forced_length(prompt_id, i) if forced_length else None
        requests.append(
            Request(
                traj_id,
                group_id,
                str(prompt_id),
                tuple(int(t) for t in prompt_ids),
                version,
                config.max_new_tokens,
                sampling,
                tuple(config.stop_ids),
                forced,
            )
        )
    return requests


def samples_in_order(scored: Mapping[str, ScoredTrajectory]) -> tuple[ScoredTrajectory, ...]:
    """A whole group's samples by their index, whatever order their rewards came back in."""
    return tuple(scored[k] for k in sorted(scored, key=lambda k: int(k.rsplit("/", 1)[1])))


class Groups:
    """The training groups in flight (not yet whole in the TransferQueue), by id. It starts them
    (the next prompt, its G requests), notes their first dispatch and their samples' run times
    (legacy fill's pace), re-tags those none of whose requests was ever sent, and hands each one
    over, its samples in order, once the last is scored."""

    def __init__(
        self,
        config: CoordinatorConfig,
        next_prompt: Callable[[], tuple[str, Sequence[int]]],
        forced_length: Callable[[str, int], int | None] | None,
        clock: Callable[[], float],
        pace: Pace,
    ):
        self._config = config
        self._next_prompt = next_prompt
        self._forced_length = forced_length
        self._clock = clock
        self._pace = pace
        self.by_id: dict[str, GroupState] = {}
        self.samples = 0  # the sum of their sizes (kept, not recounted: a hot path)
        self.unsent: set[str] = set()  # none of their requests was ever sent: only these may be re-tagged
        self.next_id = 0

    def start(self, version: int, legacy: bool = False) -> list[Request]:
        """A new prompt's G requests at `version` (`legacy`: older than the newest)."""
        group_id = f"g{self.next_id}"
        self.next_id += 1
        prompt_id, prompt_ids = self._next_prompt()
        self.by_id[group_id] = GroupState(version, self._config.group_size, legacy=legacy)
        self.samples += self._config.group_size
        self.unsent.add(group_id)
        return make_requests(group_id, prompt_id, prompt_ids, version, self._config, self._forced_length)

    def sent(self, group_id: str) -> GroupState | None:
        """A request of the group was dispatched; None for a request of no training group."""
        group = self.by_id.get(group_id)
        if group is not None and group.dispatched_at is None:
            group.dispatched_at = self._clock()
        self.unsent.discard(group_id)
        return group

    def finished(self, traj: Trajectory) -> None:
        group = self.by_id.get(traj.group_id)
        if group is not None and group.dispatched_at is not None:
            # Decode time where the worker measured it, else (migrated) dispatch to finish here.
            run_s = traj.decode_s if traj.decode_s > 0 else self._clock() - group.dispatched_at
            group.longest_s = max(group.longest_s, run_s)

    def scored(self, sample: ScoredTrajectory) -> Group | None:
        """Adds a sample's reward; returns its group, whole, once every sample has one."""
        group_id = sample.trajectory.group_id
        group = self.by_id[group_id]
        group.scored[sample.trajectory.traj_id] = sample
        if len(group.scored) < group.size:
            return None
        del self.by_id[group_id]
        if group.dispatched_at is not None:
            self._pace.group_done(group.longest_s)
        self.samples -= group.size
        return Group(group_id, group.version, samples_in_order(group.scored))

    def finished_so_far(self, shown: Set[str]) -> list[Group]:
        """Each group in flight with scored samples not in `shown`, as a group of those alone."""
        out = []
        for group_id, group in self.by_id.items():
            fresh = {k: s for k, s in group.scored.items() if k not in shown}
            if fresh:
                out.append(Group(group_id, group.version, samples_in_order(fresh)))
        return out

    def retag_unsent(self, backlog: Sequence[Request], version: int) -> list[Request]:
        """Moves the groups none of whose requests was ever sent to `version`; returns `backlog`
        with their requests re-tagged (the rest keeps its version)."""
        for group_id in self.unsent:
            self.by_id[group_id].version = version
        return [dataclasses.replace(r, version=version) if r.group_id in self.unsent else r for r in backlog]

    def move_to_legacy(self, group_id: str, version: int) -> None:
        group = self.by_id[group_id]
        group.version, group.legacy = version, True

    def legacy_ages(self, now: float) -> list[float]:
        """How long the legacy groups have run (they are admitted at dispatch)."""
        return [now - g.dispatched_at for g in self.by_id.values() if g.legacy and g.dispatched_at is not None]

    def unconsumed_by_version(self, queued_versions: Iterable[int]) -> collections.Counter[int]:
        """Samples per version not yet trained on: those of the queued groups (one version each,
        as `queued_versions` lists them) and of the groups in flight."""
        counts: collections.Counter[int] = collections.Counter()
        for version in queued_versions:
            counts[version] += self._config.group_size
        for group in self.by_id.values():
            counts[group.version] += group.size
        return counts

    def restore(self, groups: Mapping[str, GroupState], next_id: int) -> None:
        self.by_id.update(groups)
        self.samples += sum(g.size for g in groups.values())
        self.next_id = next_id
