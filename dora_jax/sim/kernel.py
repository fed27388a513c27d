"""The discrete-event kernel shared by every mode: clock, trainer, transfer queue, accounting.

A mode is a `Policy` (four callbacks). The kernel owns time and the parts every mode shares; the
policy decides what to dispatch, when groups change version and when the trainer starts.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from typing import Optional, Protocol

from dora_jax.sim.cluster import ClusterSpec, Placement
from dora_jax.sim.engine import GROUP_EVENT, EventQueue, Group, RolloutPool
from dora_jax.sim.ledger import Ev, EventLog
from dora_jax.sim.workload import LengthSource, LengthStream, WorkloadSpec


class Kind(enum.IntEnum):
    GROUP = GROUP_EVENT  # a group's earliest request finishes
    TRAIN_DONE = 1
    TIMER = 2  # periodic orchestrator tick


class Policy(Protocol):
    def start(self, sim: "Sim") -> None: ...
    def on_finished(self, sim: "Sim", group: Group, trajs: list[int]) -> None: ...
    def on_published(self, sim: "Sim") -> None: ...
    def on_timer(self, sim: "Sim") -> None: ...


class TransferQueue:
    """Whole prompt groups become ready when their G samples finish; taken oldest version first."""

    def __init__(self):
        self.members: dict[int, list[int]] = {}  # prompt -> trajectory ids
        self.version: dict[int, int] = {}  # prompt -> version it was dispatched with
        self.left: dict[int, int] = {}  # prompt -> samples not finished
        self.ready: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self.ready_samples = 0
        self.ready_by_version: collections.Counter = collections.Counter()  # version -> samples
        self.unconsumed: collections.Counter = collections.Counter()  # version -> samples
        self.total_unconsumed = 0

    def register(self, prompt: int, trajs: list[int], version: int) -> None:
        self.members[prompt], self.version[prompt], self.left[prompt] = trajs, version, len(trajs)
        self.unconsumed[version] += len(trajs)
        self.total_unconsumed += len(trajs)

    def retag(self, prompt: int, version: int) -> None:
        """A prompt none of whose samples has started moves to another version."""
        n = len(self.members[prompt])
        self.unconsumed[self.version[prompt]] -= n
        self.unconsumed[version] += n
        self.version[prompt] = version

    def finished(self, prompt: int) -> None:
        self.left[prompt] -= 1
        if self.left[prompt] == 0:
            v, n = self.version[prompt], len(self.members[prompt])
            self.ready[v].append(prompt)
            self.ready_samples += n
            self.ready_by_version[v] += n

    def window_room(self, version: int, trainer_version: int, trainer_busy: bool, k_max: int,
                    batch: int) -> int:
        """How many samples can be added at `version` and still all be consumable in time.

        Batches are taken oldest version first, so a sample of version v waits behind every
        unconsumed sample of versions <= v, and must be in a batch at trainer version <= v + K:
        cumulative(v) <= (v + K - next trainer version + 1) x batch for every v >= version.
        """
        room, cumulative = 1 << 62, 0
        for v in sorted({v for v, n in self.unconsumed.items() if n} | {version}):
            cumulative += self.unconsumed[v]
            if v >= version:
                batches = v + k_max - (trainer_version + int(trainer_busy)) + 1
                room = min(room, batches * batch - cumulative)
        return room

    def take(self, samples: int, window: Optional[tuple[int, int]] = None) -> Optional[list[int]]:
        """Pops whole prompts, oldest versions first, up to `samples` samples.

        With `window=(k_max, trainer_version)` the batch is refused (None, nothing popped) unless
        afterwards every unconsumed sample can still be consumed in time:
        cumulative(v) <= (v + K - trainer_version) x samples for every version v. For the oldest
        versions this is the version window (nothing below t+1-K left); for the others it stops
        newer ready samples from using up batches that samples still being generated need.
        """
        if self.ready_samples < samples:
            return None
        picked, taken, count = [], collections.Counter(), 0
        for v in sorted(self.ready):
            for p in self.ready[v]:
                if count >= samples:
                    break
                n = len(self.members[p])
                picked.append(p)
                taken[v] += n
                count += n
        if window is not None:
            k_max, trainer_version = window
            cumulative = 0
            for v in sorted(v for v, n in self.unconsumed.items() if n):
                cumulative += self.unconsumed[v] - taken[v]
                if cumulative > (v + k_max - trainer_version) * samples:
                    return None
        for p in picked:  # a prefix of each version's ready deque
            v, n = self.version[p], len(self.members[p])
            self.ready[v].popleft()
            if not self.ready[v]:
                del self.ready[v]
            self.ready_samples -= n
            self.ready_by_version[v] -= n
            self.unconsumed[v] -= n
            self.total_unconsumed -= n
        return picked


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Cumulative counters at one publish."""

    t: float
    step: int
    rollout_only_s: float
    train_busy_s: float
    colocated_train_s: float
    busy_slot_s: float
    tokens: int
    migration_s: float
    prefill_tokens: float
    weight_loads: int


class Sim:
    """One simulated run of one mode."""

    def __init__(self, cluster: ClusterSpec, workload: WorkloadSpec, policy: Policy, steps: int,
                 chunk_tokens: float, kv_migration: bool = True,
                 lengths: Optional[LengthSource] = None):
        self.cluster, self.workload, self.policy, self.steps = cluster, workload, policy, steps
        self.now = 0.0
        self.queue = EventQueue()
        self.log = EventLog()
        self.pool = RolloutPool(cluster, self.queue, self.log, workload.prompt_tokens,
                                workload.samples_per_prompt, chunk_tokens, kv_migration)
        self.stream = lengths if lengths is not None else LengthStream(workload)
        self.transfer = TransferQueue()
        self.version = 0  # newest published version; the trainer holds it too
        self.steps_done = 0
        self.trainer_busy = False
        self.tokens_consumed = 0
        self.consumed: set[int] = set()
        self.snapshots: list[Snapshot] = []
        self._acc = dict(rollout_only=0.0, train_busy=0.0, colocated=0.0)
        self._last = 0.0

    # ---- services for policies ------------------------------------------------------------------
    def dispatch(self, prompts: int, version: int) -> None:
        for _ in range(prompts):
            ids = self.pool.dispatch_prompt(self.stream.next_prompt(), version, self.now)
            self.transfer.register(self.pool.prompt_of[ids[0]], ids, version)

    def train(self, prompts: list[int]) -> None:
        """Starts one optimizer step on these prompt groups (trainer version = self.version)."""
        assert not self.trainer_busy
        tokens = 0
        for p in prompts:
            for traj in self.transfer.members[p]:
                tokens += self.pool.length[traj]
                self.consumed.add(traj)
                self.log.add(Ev.CONSUME, self.now, traj, self.steps_done, self.version)
        n = sum(len(self.transfer.members[p]) for p in prompts)
        self.tokens_consumed += tokens
        self.trainer_busy = True
        duration = self.cluster.train_time(tokens + n * self.workload.prompt_tokens)
        self.queue.push(self.now + duration, Kind.TRAIN_DONE)

    def supplement(self, rbs: int, k_max: int) -> None:
        """Tops in-flight samples up to `rbs` with new prompts on the newest version.

        Staleness-aware: a sample dispatched now must be consumed within the next k_max (+1 if
        the trainer is idle) batches, so no more is dispatched than the window lets the trainer
        consume (see TransferQueue.window_room); otherwise a fast rollout would queue samples
        that would have to go stale.
        """
        room = min(rbs - self.pool.unfinished(), self.window_room(self.version, k_max))
        g = self.workload.samples_per_prompt
        if room >= g:
            self.dispatch(room // g, self.version)

    def window_room(self, version: int, k_max: int) -> int:
        return self.transfer.window_room(version, self.version, self.trainer_busy, k_max,
                                         self.workload.batch_samples)

    def retag_unstarted(self) -> None:
        """Re-dispatches every prompt with no started sample onto the newest version."""
        pool, g = self.pool, self.workload.samples_per_prompt
        moved: list[int] = []
        for v in [v for v in pool.pending if v != self.version]:
            queue = pool.pending[v]
            counts = collections.Counter(pool.prompt_of[t] for t in queue)
            keep = collections.deque()
            for traj in queue:
                prompt = pool.prompt_of[traj]
                if counts[prompt] == g:
                    if traj == self.transfer.members[prompt][0]:
                        self.transfer.retag(prompt, self.version)
                    pool.version[traj] = self.version
                    self.log.add(Ev.DISPATCH, self.now, traj, prompt, self.version)
                    moved.append(traj)
                else:
                    keep.append(traj)
            if keep:
                pool.pending[v] = keep
            else:
                del pool.pending[v]
        pool.pending[self.version].extendleft(reversed(moved))

    def refill_all(self) -> None:
        for g in self.pool.groups:
            self.pool.fill(g, self.now)

    # ---- the loop ---------------------------------------------------------------------------------
    def run(self) -> None:
        self.policy.start(self)
        self._snapshot()
        idle_ticks = 0  # timer ticks in a row with nothing running and nothing training: a deadlock
        while self.steps_done < self.steps:
            if not len(self.queue) or idle_ticks > 1_000:
                raise RuntimeError(f"simulation stalled at t={self.now:.1f}s, step {self.steps_done}")
            t, kind, payload, epoch = self.queue.pop()
            if kind == Kind.GROUP and self.pool.groups[payload].epoch != epoch:
                continue
            stuck = kind == Kind.TIMER and not self.trainer_busy and not self.pool.total_active
            idle_ticks = idle_ticks + 1 if stuck else 0
            self._account(t)
            self.now = t
            if kind == Kind.GROUP:
                g = self.pool.groups[payload]
                done = self.pool.complete(g, t)
                for traj in done:
                    self.transfer.finished(self.pool.prompt_of[traj])
                self.policy.on_finished(self, g, done)
                self.pool.schedule(g)
            elif kind == Kind.TRAIN_DONE:
                self.trainer_busy = False
                self.version += 1
                self.steps_done += 1
                self.log.add(Ev.PUBLISH, t, self.version, self.steps_done - 1)
                self._snapshot()
                self.policy.on_published(self)
            else:
                self.policy.on_timer(self)
        for traj in range(len(self.pool.length)):
            if traj not in self.consumed:
                self.log.add(Ev.LIVE_AT_END, self.now, traj)

    def _account(self, t: float) -> None:
        dt = t - self._last
        if dt <= 0:
            return
        if self.trainer_busy:
            self._acc["train_busy"] += dt
            if self.cluster.placement == Placement.COLOCATED:
                self._acc["colocated"] += dt
        elif self.pool.total_active:
            self._acc["rollout_only"] += dt
        self._last = t

    def _snapshot(self) -> None:
        self.pool.settle_all(self.now)
        self.snapshots.append(Snapshot(
            t=self.now,
            step=self.steps_done,
            rollout_only_s=self._acc["rollout_only"],
            train_busy_s=self._acc["train_busy"],
            colocated_train_s=self._acc["colocated"],
            busy_slot_s=self.pool.busy_slot_s(),
            tokens=self.tokens_consumed,
            migration_s=self.pool.migration_s,
            prefill_tokens=self.pool.prefill_tokens,
            weight_loads=self.pool.weight_loads,
        ))
