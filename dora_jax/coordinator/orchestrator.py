"""DORA's load-balancing orchestrator (PAPER.md, "Algorithm 1") as a pure planning function.

Given where every in-flight request sits and which version each slice serves, `plan_rebalance`
returns what to do; the coordinator carries it out through the ports. One cycle:
  1. supplement: new requests (already made by the caller) belong to the newest version only;
  2. repartition: DP_w = round(N * R_w / sum_w R_w) slices per live version (largest remainder,
     at least one slice for every version that still has requests, C1 first);
  3. migrate: old-version slices beyond their share are emptied by moving their requests, with
     their KV slot state, onto slices that keep serving that version (the request's original
     slice first); a slice that cannot be emptied within free capacity stays where it is; emptied
     slices and idle old-version slices switch to the newest version;
  4. fill: queued (not yet admitted) requests move from over-full slices to same-version slices
     with free slots; new requests go to the newest version's least-loaded slices.

`views` builds the planner's input from the coordinator's tables, `still_possible` drops the fills
that the plan's earlier steps made void, and `under_pressure` is the trigger the coordinator checks
as requests finish.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from collections.abc import Collection, Container, Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class SliceView:
    slice_id: int
    version: int | None  # None: nothing loaded yet
    num_slots: int
    trajs: tuple[str, ...]  # requests on the slice (admitted or queued), oldest first

    @property
    def free(self) -> int:
        return self.num_slots - len(self.trajs)


@dataclasses.dataclass(frozen=True)
class Migration:
    traj_id: str
    src: int
    dst: int


@dataclasses.dataclass(frozen=True)
class Plan:
    migrations: tuple[Migration, ...] = ()
    switches: tuple[tuple[int, int], ...] = ()  # (slice_id, new version), after migrations
    placements: tuple[tuple[str, int], ...] = ()  # (new traj id, slice id), after switches
    fills: tuple[Migration, ...] = ()  # queued requests to same-version free slots, last
    targets: Mapping[int, int] = dataclasses.field(default_factory=dict)  # version -> DP_w


def target_partition(loads: Mapping[int, int], num_slices: int, newest: int) -> dict[int, int]:
    """DP_w by largest remainder; every version with load keeps >= 1 slice; idle versions get 0."""
    live = {v: r for v, r in loads.items() if r > 0}
    if not live:
        return {newest: num_slices}
    total = sum(live.values())
    exact = {v: num_slices * r / total for v, r in live.items()}
    counts = {v: max(1, int(e)) for v, e in exact.items()}
    order = sorted(live, key=lambda v: (exact[v] - int(exact[v]), v), reverse=True)
    spare = num_slices - sum(counts.values())
    for v in order:
        if spare <= 0:
            break
        counts[v] += 1
        spare -= 1
    while spare < 0:  # more live versions than slices can hold at one each: newest gives way last
        donor = max((v for v in counts if counts[v] > 1), key=lambda v: counts[v], default=None)
        if donor is None:
            break
        counts[donor] -= 1
        spare += 1
    return counts


def plan_rebalance(
    slices: Sequence[SliceView],
    newest: int,
    new_trajs: Sequence[str] = (),
    origin: Mapping[str, int] | None = None,
) -> Plan:
    origin = origin or {}
    trajs = {s.slice_id: list(s.trajs) for s in slices}
    version = {s.slice_id: s.version for s in slices}
    slots = {s.slice_id: s.num_slots for s in slices}
    loads = collections.Counter()
    for s in slices:
        if s.version is not None:
            loads[s.version] += len(s.trajs)
    loads[newest] += len(new_trajs)
    targets = target_partition(loads, len(slices), newest)

    migrations, switches = [], []
    for v in sorted(v for v in set(version.values()) if v is not None and v != newest):
        members = [sid for sid in version if version[sid] == v]
        excess = len(members) - targets.get(v, 0)
        for sid in sorted(members, key=lambda s: len(trajs[s]))[: max(excess, 0)]:
            keepers = [k for k in members if k != sid and version[k] == v]
            moves = _empty_slice(sid, trajs, keepers, slots, origin)
            if moves is None:
                continue  # cannot empty it within free capacity: C1 first, it stays
            migrations += moves
            version[sid] = newest
            switches.append((sid, newest))
    # Versions with a slice holding more than it has slots (queued requests). Computed once: a
    # slice that switches below is empty, so it never changes this set.
    queued = {version[k] for k in version if len(trajs[k]) > slots[k]}
    for sid in version:  # unloaded slices, and empty old-version slices nobody queues for
        v = version[sid]
        if v is None or (v != newest and not trajs[sid] and v not in queued):
            version[sid] = newest
            switches.append((sid, newest))

    placements = _place(new_trajs, [sid for sid in version if version[sid] == newest], trajs, slots)
    fills = _fill(version, trajs, slots)
    return Plan(tuple(migrations), tuple(switches), tuple(placements), tuple(fills), targets)


def views(
    versions: Mapping[int, int | None],
    slots: Mapping[int, int],
    trajs: Mapping[int, Collection[str]],
    draining: Container[int],
) -> list[SliceView]:
    """The live slices (those in `trajs`) as the planner sees them, less those draining for an
    old version (they take no new work)."""
    return [
        SliceView(sid, versions[sid], slots[sid], tuple(held)) for sid, held in trajs.items() if sid not in draining
    ]


def under_pressure(
    versions: Mapping[int, int | None], trajs: Mapping[int, Collection[str]], slots: Mapping[int, int], newest: int
) -> bool:
    """A slice has queued work while a same-version slice has free slots, or an old-version
    slice sits empty while newer work waits (per slice: its version, requests and slots)."""
    # One pass (it runs on every batch of finishes; thousands of slices at pod scale): the
    # versions with a slice that has a free slot; an over-full slice is never one of them.
    free = {versions[s] for s in trajs if len(trajs[s]) < slots[s]}
    for sid, held in trajs.items():
        v = versions[sid]
        if (len(held) > slots[sid] and v in free) or (not held and v != newest):
            return True
    return False


def still_possible(
    moves: Sequence[Migration], versions: Mapping[int, int | None], trajs: Mapping[int, Collection[str]]
) -> list[Migration]:
    """The planned moves that still hold once the plan's earlier steps ran: both slices live (in
    `trajs`) and at one version, the request still on its source (it may have finished)."""
    return [
        m
        for m in moves
        if m.src in trajs and m.dst in trajs and versions[m.src] == versions[m.dst] and m.traj_id in trajs[m.src]
    ]


class _MostFree:
    """The slice with the most free slots, lowest id on a tie, under decrements: a heap with lazy
    deletion, O(log n) a step where a scan over every slice was O(n) (thousands of slices at pod scale)."""

    def __init__(self, free: dict[int, int]):
        self.free = free
        self._heap = [(-f, k) for k, f in free.items()]
        heapq.heapify(self._heap)

    def __bool__(self) -> bool:
        return bool(self.free)

    def top(self) -> int:
        while True:
            neg, k = self._heap[0]
            if self.free.get(k) == -neg:
                return k
            heapq.heappop(self._heap)  # stale: decremented or removed since it was pushed

    def take(self, k: int) -> None:
        self.free[k] -= 1
        heapq.heappush(self._heap, (-self.free[k], k))

    def remove(self, k: int) -> None:
        del self.free[k]


def _empty_slice(sid, trajs, keepers, slots, origin) -> list[Migration] | None:
    free = {k: slots[k] - len(trajs[k]) for k in keepers}
    if sum(max(f, 0) for f in free.values()) < len(trajs[sid]):
        return None
    most = _MostFree(free)
    moves = []
    for traj in list(trajs[sid]):
        home = origin.get(traj)
        dst = home if home in free and free[home] > 0 else most.top()
        most.take(dst)
        moves.append(Migration(traj, sid, dst))
    for move in moves:
        trajs[move.dst].append(move.traj_id)
    trajs[sid] = []
    return moves


def _place(new_trajs, targets, trajs, slots) -> list[tuple[str, int]]:
    """Each request to the target slice with the most free slots (lowest id on a tie)."""
    placements = []
    if not targets:
        return placements
    free = [(len(trajs[k]) - slots[k], k) for k in targets]  # a min-heap of (-free, id)
    heapq.heapify(free)
    for traj in new_trajs:
        used, dst = free[0]
        trajs[dst].append(traj)
        placements.append((traj, dst))
        heapq.heapreplace(free, (used + 1, dst))
    return placements


def _fill(version, trajs, slots) -> list[Migration]:
    """Moves the most recently placed (so most likely still queued) requests of over-full slices
    to slices of the same version with free slots."""
    moves = []
    by_version: dict[int | None, list[int]] = {}
    for sid in version:
        by_version.setdefault(version[sid], []).append(sid)
    for members in by_version.values():
        over = [s for s in members if len(trajs[s]) > slots[s]]
        if not over:
            continue
        under = _MostFree({s: slots[s] - len(trajs[s]) for s in members if len(trajs[s]) < slots[s]})
        for src in over:
            while len(trajs[src]) > slots[src] and under:
                dst = under.top()
                traj = trajs[src].pop()
                trajs[dst].append(traj)
                moves.append(Migration(traj, src, dst))
                under.take(dst)
                if under.free[dst] == 0:
                    under.remove(dst)
    return moves
