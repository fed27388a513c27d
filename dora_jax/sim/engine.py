"""Rollout pool of the simulator: groups with lazy decode clocks, and the global event queue.

A group's decode clock counts decode steps taken. Between events it advances continuously at
1 / t(a) steps per second (a = active slots) except while the group is stalled (prefill, weight
load), so a request admitted at clock value c with r tokens left finishes when the clock reaches
c + r. Each group schedules one event: the time its earliest request finishes. At that event every
request within `chunk_tokens` of finishing also finishes ("chunk" granularity: at most that many
decode steps early), so a paper-scale step costs a few thousand events, not millions.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from typing import Optional

from dora_jax.sim.cluster import ClusterSpec
from dora_jax.sim.ledger import Ev, EventLog


@dataclasses.dataclass
class Group:
    """Mutable state of one rollout group (internal to the simulator)."""

    gid: int
    version: int
    steps: float = 0.0  # decode clock at t_last
    t_last: float = 0.0
    stall_end: float = 0.0
    epoch: int = 0  # invalidates this group's stale queue entries
    busy_slot_s: float = 0.0  # integral of active slots over time
    active: dict = dataclasses.field(default_factory=dict)  # traj -> clock value at which it ends
    heap: list = dataclasses.field(default_factory=list)  # (end clock, traj), lazily cleaned


class EventQueue:
    """Time-ordered events; ties break by insertion order, so runs are deterministic."""

    def __init__(self):
        self._heap: list = []
        self._seq = 0

    def push(self, t: float, kind: int, payload: int = -1, epoch: int = -1) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload, epoch))

    def pop(self) -> tuple:
        t, _, kind, payload, epoch = heapq.heappop(self._heap)
        return t, kind, payload, epoch

    def __len__(self) -> int:
        return len(self._heap)


GROUP_EVENT = 0  # queue kind used by the pool; policies use other kinds


class RolloutPool:
    """Groups, per-version pending queues and the trajectory store."""

    def __init__(self, cluster: ClusterSpec, queue: EventQueue, log: EventLog, prompt_tokens: int,
                 samples_per_prompt: int, chunk_tokens: float, kv_migration: bool = True):
        self.cluster = cluster
        self.queue = queue
        self.log = log
        self.prompt_tokens = prompt_tokens
        # The G samples of a prompt share its prefix cache: each pays 1/G of the prompt's prefill.
        self.prompt_prefill = prompt_tokens / samples_per_prompt
        self.kv_migration = kv_migration  # False: a migrated request re-prefills (ablation)
        self.chunk = max(float(chunk_tokens), 1e-9)
        self.slots = cluster.slots_per_group
        self._t0, self._t1 = cluster.decode.t0_s, cluster.decode.t1_s
        self.groups = [Group(gid=i, version=0) for i in range(cluster.num_groups)]
        self.pending: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self.total_active = 0
        # Trajectory store, indexed by trajectory id.
        self.length: list[int] = []  # target response tokens
        self.prompt_of: list[int] = []
        self.version: list[int] = []  # version the trajectory is tagged with now
        self.remaining: list[float] = []  # tokens left, valid while not on a group
        self.prefill_due: list[float] = []  # tokens to prefill at the next admission
        self.where: list[int] = []  # group id while active, -1 otherwise
        self.migrations = 0
        self.migration_s = 0.0
        self.prefill_tokens = 0.0
        self.weight_loads = 0

    # ---- clocks -------------------------------------------------------------------------------
    def step_time(self, active: int) -> float:
        return self._t0 + self._t1 * active

    def settle(self, g: Group, now: float) -> None:
        """Advances g's clock and occupancy integral to `now`."""
        if now <= g.t_last:
            return
        n = len(g.active)
        if n:
            start = g.stall_end if g.stall_end > g.t_last else g.t_last
            if now > start:
                g.steps += (now - start) / (self._t0 + self._t1 * n)
            g.busy_slot_s += n * (now - g.t_last)
        g.t_last = now

    def schedule(self, g: Group) -> None:
        """(Re)schedules g's next finish event; call after every change to g."""
        g.epoch += 1
        heap, active = g.heap, g.active
        while heap and active.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        if not heap:
            return
        start = g.stall_end if g.stall_end > g.t_last else g.t_last
        dt = max(0.0, heap[0][0] - g.steps) * (self._t0 + self._t1 * len(active))
        self.queue.push(start + dt, GROUP_EVENT, g.gid, g.epoch)

    def settle_all(self, now: float) -> None:
        for g in self.groups:
            self.settle(g, now)

    # ---- trajectories -------------------------------------------------------------------------
    def dispatch_prompt(self, lengths: list[int], version: int, now: float) -> list[int]:
        """Creates G trajectories of one prompt, tagged `version`, queued for that version."""
        prompt = self.prompt_of[-1] + 1 if self.prompt_of else 0
        ids = []
        for n in lengths:
            traj = len(self.length)
            self.length.append(n)
            self.prompt_of.append(prompt)
            self.version.append(version)
            self.remaining.append(float(n))
            self.prefill_due.append(self.prompt_prefill)
            self.where.append(-1)
            self.pending[version].append(traj)
            self.log.add(Ev.DISPATCH, now, traj, prompt, version)
            ids.append(traj)
        return ids

    def admit(self, g: Group, traj: int, now: float) -> None:
        """Puts a pending trajectory into a free slot of g (prefilling its due tokens)."""
        self.settle(g, now)
        prefill = self.prefill_due[traj]
        if prefill:
            g.stall_end = max(g.stall_end, now) + prefill * self.cluster.prefill_s_per_token
            self.prefill_tokens += prefill
            self.prefill_due[traj] = 0.0
        end = g.steps + self.remaining[traj]
        g.active[traj] = end
        heapq.heappush(g.heap, (end, traj))
        self.where[traj] = g.gid
        self.total_active += 1
        self.log.add(Ev.ADMIT, now, traj, g.version, g.gid)

    def fill(self, g: Group, now: float, schedule: bool = True) -> None:
        """Admits pending trajectories of g's version into g's free slots (then reschedules g)."""
        queue = self.pending.get(g.version)
        while queue and len(g.active) < self.slots:
            self.admit(g, queue.popleft(), now)
        if schedule:
            self.schedule(g)

    def retag_pending(self, version: int, now: float) -> list[int]:
        """Moves every pending trajectory to `version`; unstarted ones are re-dispatched with it."""
        moved = []
        for old in [v for v in self.pending if v != version]:
            queue = self.pending.pop(old)
            for traj in queue:
                self.version[traj] = version
                if self.remaining[traj] == self.length[traj]:
                    self.log.add(Ev.DISPATCH, now, traj, self.prompt_of[traj], version)
            moved.extend(queue)
        self.pending[version].extend(moved)
        return moved

    def take_out(self, g: Group, traj: int, now: float) -> float:
        """Removes an active trajectory from g; returns (and stores) its remaining tokens."""
        self.settle(g, now)
        left = max(0.0, g.active.pop(traj) - g.steps)
        self.remaining[traj] = left
        self.where[traj] = -1
        self.total_active -= 1
        return left

    def generated(self, traj: int) -> float:
        """Tokens generated so far (for a trajectory not on a group)."""
        return self.length[traj] - self.remaining[traj]

    def complete(self, g: Group, now: float) -> list[int]:
        """Handles g's finish event: returns the trajectories that finished (within a chunk)."""
        self.settle(g, now)
        limit = g.steps + self.chunk
        heap, active, done = g.heap, g.active, []
        while heap and heap[0][0] <= limit:
            end, traj = heapq.heappop(heap)
            if active.get(traj) != end:
                continue
            del active[traj]
            self.where[traj] = -1
            self.remaining[traj] = 0.0
            done.append(traj)
            self.log.add(Ev.FINISH, now, traj, self.length[traj])
        self.total_active -= len(done)
        return done

    def migrate(self, traj: int, src: Group, dst: Group, now: float) -> None:
        """Moves an in-flight request with its KV cache to dst (same version): no re-prefill.

        The request itself pauses for the KV transfer (it loses that many of dst's decode steps);
        the other requests on dst keep decoding. Without KV migration (ablation) dst instead
        re-prefills the request's prompt share and generated tokens, stalling all of dst.
        """
        assert src.version == dst.version, "migration only between groups serving one version"
        left = self.take_out(src, traj, now)
        self.settle(dst, now)
        self.migrations += 1
        transfer = 0.0
        if self.kv_migration:
            transfer = self.cluster.migrate_time(self.prompt_tokens + self.generated(traj))
            self.migration_s += transfer
        else:
            tokens = self.prompt_prefill + self.generated(traj)
            dst.stall_end = max(dst.stall_end, now) + tokens * self.cluster.prefill_s_per_token
            self.prefill_tokens += tokens
        end = dst.steps + left + transfer / self.step_time(len(dst.active) + 1)
        dst.active[traj] = end
        heapq.heappush(dst.heap, (end, traj))
        self.where[traj] = dst.gid
        self.total_active += 1
        self.log.add(Ev.MIGRATE, now, traj, dst.version, src.gid, dst.gid)

    def interrupt(self, g: Group, traj: int, now: float) -> None:
        """Partial rollout: stops a request; it must re-prefill prompt + generated tokens.

        The new version invalidates every cached key/value, the prompt's included (whose prefill
        the G samples again share)."""
        self.take_out(g, traj, now)
        self.prefill_due[traj] = self.prompt_prefill + self.generated(traj)
        self.log.add(Ev.INTERRUPT, now, traj, g.version, g.gid)

    def switch(self, g: Group, version: int, now: float) -> None:
        """Loads another version's weights on an empty group (stalls it weight_load_s)."""
        assert not g.active, "a group changes version only when empty"
        if g.version == version:
            return
        self.settle(g, now)
        g.version = version
        g.stall_end = max(g.stall_end, now) + self.cluster.weight_load_s
        self.weight_loads += 1

    def unfinished(self) -> int:
        """Dispatched trajectories not finished yet (active or pending)."""
        return self.total_active + sum(len(q) for q in self.pending.values())

    def busy_slot_s(self) -> float:
        return sum(g.busy_slot_s for g in self.groups)

    def group_of(self, traj: int) -> Optional[Group]:
        gid = self.where[traj]
        return self.groups[gid] if gid >= 0 else None
