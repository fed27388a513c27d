"""The discrete-event kernel: the shipped coordinator, simulated slices and trainer, one clock.

The policy is not simulated: `dora_jax.coordinator.Coordinator` (its mode table, supply rule,
version window and orchestrator) runs unchanged and writes its ledger, exactly as in a real run.
The kernel owns what a real run gets from hardware, on a virtual clock:
- rollout slices (`SimSlice`, the coordinator's ports) that decode, prefill, load weights and take
  KV caches at modelled cost and post finished trajectories;
- a trainer that takes batches with `try_take_batch`, trains for the modelled step time (lending
  every rollout accelerator when colocated) and posts each new version;
- an instant reward, a prompt source whose responses stop at drawn lengths, and the accounting
  (snapshots at every publish) that the metrics are computed from.
After an event that posted something, the coordinator applies it (`process`, one iteration of its
loop), then the trainer tries to take a batch; port calls made meanwhile happen at that time. With
`coordinator_tick_s` > 0 the loop runs at most once per tick, as a busy coordinator batches what
arrived meanwhile: slices keep decoding in between, only the coordinator's decisions wait.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import math
import os
import time
from concurrent.futures import Future
from contextlib import contextmanager

from dora_jax.coordinator.coordinator import Coordinator, CoordinatorConfig
from dora_jax.coordinator.ledger import Ledger
from dora_jax.core.modes import Switch
from dora_jax.core.records import Trajectory
from dora_jax.sim.cluster import ClusterSpec, Placement
from dora_jax.sim.rollout_slice import SimSlice
from dora_jax.sim.workload import LengthSource, LengthStream, WorkloadSpec


class Kind(enum.IntEnum):
    SLICE = 0  # a slice's earliest request finishes
    TRAIN_DONE = 1
    TIMER = 2  # lets the coordinator's periodic rebalance run
    PROCESS = 3  # the coordinator's loop applies what was posted since its last iteration


class EventQueue:
    """Time-ordered events; ties break by insertion order, so runs are deterministic."""

    def __init__(self):
        self._heap: list = []
        self._seq = 0

    def push(self, t: float, kind: Kind, payload: int = -1, epoch: int = -1) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload, epoch))

    def pop(self) -> tuple[float, Kind, int, int]:
        t, _, kind, payload, epoch = heapq.heappop(self._heap)
        return t, kind, payload, epoch

    def __len__(self) -> int:
        return len(self._heap)


class VirtualClock:
    """Simulated seconds; the coordinator's ledger and timers read it."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Prompts:
    """The coordinator's prompt source: prompt ids whose G responses stop at drawn lengths.

    The prompt's tokens are not materialised (the slices charge `prompt_tokens` of prefill); its
    responses' lengths reach the slices as each request's `forced_length`."""

    def __init__(self, lengths: LengthSource):
        self._lengths = lengths
        self._drawn: dict[str, list[int]] = {}

    def next_prompt(self) -> tuple[str, tuple[int, ...]]:
        prompt_id = f"p{len(self._drawn)}"
        self._drawn[prompt_id] = self._lengths.next_prompt()
        return prompt_id, ()

    def forced_length(self, prompt_id: str, index: int) -> int:
        return self._drawn[prompt_id][index]


class InstantReward:
    """Rewards are off the simulated critical path: every sample scores 0 at once. One resolved
    future serves every sample (a callback added to a done future runs at once and is not kept)."""

    def __init__(self):
        self._scored: Future = Future()
        self._scored.set_result((0.0, None))

    def submit(self, trajectory: Trajectory) -> Future[tuple[float, str | None]]:
        return self._scored


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
    coordinator_s: float  # host CPU seconds inside the coordinator (simulated ports' own time excluded)


class _MeteredPort:
    """A simulated slice as the coordinator sees it: every call's CPU time is added to `meter`,
    so that the coordinator's own cost can be told apart from the simulator's."""

    def __init__(self, port: SimSlice, meter: list[float]):
        self._port, self._meter = port, meter

    def __getattr__(self, name):
        value = getattr(self._port, name)
        if not callable(value):
            return value

        def metered(*args, **kwargs):
            start = time.thread_time()
            try:
                return value(*args, **kwargs)
            finally:
                self._meter[0] += time.thread_time() - start

        setattr(self, name, metered)  # made once per method: later lookups find it without __getattr__
        return metered


class Sim:
    """One simulated run of one mode: `run()` until the trainer has published `steps` versions."""

    def __init__(
        self,
        cluster: ClusterSpec,
        workload: WorkloadSpec,
        config: CoordinatorConfig,
        steps: int,
        chunk_tokens: float,
        *,
        coordinator_tick_s: float = 0.0,
        kv_migration: bool = True,
        lengths: LengthSource | None = None,
        ledger_path: str | None = None,
    ):
        if config.train_batch_size != workload.batch_samples or config.group_size != workload.samples_per_prompt:
            raise ValueError("the coordinator's train_batch_size and group_size must match the workload")
        self.cluster, self.workload, self.steps = cluster, workload, steps
        self.clock = VirtualClock()
        self.queue = EventQueue()
        self.ports = {
            sid: SimSlice(
                sid,
                cluster,
                prompt_tokens=workload.prompt_tokens,
                samples_per_prompt=workload.samples_per_prompt,
                chunk_tokens=chunk_tokens,
                clock=self.clock,
                on_change=self._changed,
                kv_migration=kv_migration,
            )
            for sid in range(cluster.num_groups)
        }
        self._epoch = dict.fromkeys(self.ports, 0)  # invalidates a slice's superseded finish events
        self._dirty: set[int] = set()
        # Slices with an admitted request, kept up to date in `_reschedule` (a slice's requests
        # change only where it reports a change): `_account` runs on every event, and scanning
        # a thousand slices there cost more than the events themselves at 4,096 accelerators.
        self._decoding: set[int] = set()
        if ledger_path and os.path.exists(ledger_path):
            os.remove(ledger_path)  # the Ledger appends; a simulated run starts its own
        self.ledger = Ledger(ledger_path, clock=self.clock)
        prompts = Prompts(lengths if lengths is not None else LengthStream(workload))
        self._port_s = [0.0]  # CPU seconds inside simulated ports, called by the coordinator
        # CPU seconds of this thread inside the coordinator, its port calls excluded: CPU, not wall
        # time, so that other jobs on a shared machine do not inflate the coordinator's cost.
        self.coordinator_s = 0.0
        self.coordinator = Coordinator(
            config,
            {sid: _MeteredPort(port, self._port_s) for sid, port in self.ports.items()},
            prompts.next_prompt,
            InstantReward(),
            self.ledger,
            forced_length=prompts.forced_length,
            clock=self.clock,
            # a switching pass's cost: CPU time of this thread, the simulated slices' share excluded
            cost_timer=lambda: time.thread_time() - self._port_s[0],
        )
        self._timer = config.rebalance_period_s
        self._timer_on = self.coordinator.policy.switch == Switch.ORCHESTRATE and self._timer < float("inf")
        self._tick = coordinator_tick_s  # 0: the coordinator applies every event at once
        self._posted = False  # something was posted that the coordinator has not applied
        self._tick_due = False  # a PROCESS event is scheduled
        self.version = 0  # the trainer's: the newest version it published
        self.steps_done = 0
        self.trainer_busy = False
        self.tokens_consumed = 0
        self.window_waits = 0  # a full batch was ready and the version window held it back
        self._unfinished_groups: dict[str, int] = {}  # group -> samples finished, until complete
        self._ready = 0  # samples in complete groups, not taken yet
        self.snapshots: list[Snapshot] = []
        self._rollout_only_s = 0.0  # some request active, trainer idle
        self._train_busy_s = 0.0
        self._lent_s = 0.0  # colocated: rollout accelerators training
        self._last = 0.0

    # ------------------------------------------------------------------ the loop
    @contextmanager
    def _in_coordinator(self):
        """Charges the block's CPU time, less the simulated ports' share, to the coordinator."""
        start, ports = time.thread_time(), self._port_s[0]
        try:
            yield
        finally:
            self.coordinator_s += time.thread_time() - start - (self._port_s[0] - ports)

    def run(self) -> None:
        with self._in_coordinator():
            self.coordinator.start()
        self._reschedule()
        self._snapshot()
        if self._timer_on:
            self.queue.push(self._timer, Kind.TIMER)
        idle_ticks = 0  # timer ticks with nothing decoding or training: a deadlock
        while self.steps_done < self.steps:
            if not len(self.queue) or idle_ticks > 1_000:
                raise RuntimeError(f"simulation stalled at t={self.clock.now:.1f}s, step {self.steps_done}")
            t, kind, payload, epoch = self.queue.pop()
            if kind == Kind.SLICE and self._epoch[payload] != epoch:
                continue
            self._account(t)
            self.clock.now = t
            if kind == Kind.SLICE:
                self._posted |= self._finished(self.ports[payload], t)
            elif kind == Kind.TRAIN_DONE:
                self._publish()
                self._posted = True
            elif kind == Kind.TIMER:
                stuck = not self.trainer_busy and not self._decoding
                idle_ticks = idle_ticks + 1 if stuck else 0
                self.queue.push(t + self._timer, Kind.TIMER)
                self._posted = True  # the periodic trigger runs inside `process`
            else:
                self._tick_due = False
                self._process()
            if self._posted and not self._tick_due:
                if self._tick:
                    self.queue.push((math.floor(t / self._tick) + 1) * self._tick, Kind.PROCESS)
                    self._tick_due = True
                else:
                    self._process()
            self._reschedule()
        with self._in_coordinator():
            self.coordinator.process()  # the last publish reaches the ledger
        self.ledger.close()

    def _process(self) -> None:
        """One iteration of the coordinator's loop, then the trainer's attempt to take a batch."""
        self._posted = False
        with self._in_coordinator():
            self.coordinator.process()
        self._try_train()

    def _finished(self, port: SimSlice, now: float) -> bool:
        done = port.finish(now)
        if not done:
            return False
        with self._in_coordinator():
            self.coordinator.post_finished(port.slice_id, done)
        g = self.workload.samples_per_prompt
        for traj in done:
            count = self._unfinished_groups.get(traj.group_id, 0) + 1
            if count == g:
                self._unfinished_groups.pop(traj.group_id, None)
                self._ready += g
            else:
                self._unfinished_groups[traj.group_id] = count
        return True

    # ------------------------------------------------------------------ the trainer
    def _try_train(self) -> None:
        if self.trainer_busy or self.steps_done >= self.steps:
            return
        with self._in_coordinator():
            batch = self.coordinator.try_take_batch(self.version)
            if batch is not None:
                self.coordinator.process()  # the take's follow-up: supply, switching
        if batch is None:
            self.window_waits += self._ready >= self.workload.batch_samples
            return
        samples = sum(len(group.samples) for group in batch)
        tokens = sum(group.num_tokens for group in batch)
        self._ready -= samples
        self.tokens_consumed += tokens
        self.trainer_busy = True
        now = self.clock.now
        duration = self.cluster.train_time(tokens + samples * self.workload.prompt_tokens)
        if self.cluster.placement == Placement.COLOCATED:
            for port in self.ports.values():
                port.lend(now, duration)
        self.queue.push(now + duration, Kind.TRAIN_DONE)

    def _publish(self) -> None:
        self.trainer_busy = False
        self.version += 1
        self.steps_done += 1
        with self._in_coordinator():
            self.coordinator.post_published(self.version)
            self.coordinator.process()
        self._snapshot()

    # ------------------------------------------------------------------ slices' finish events
    def _changed(self, port: SimSlice) -> None:
        self._dirty.add(port.slice_id)

    def _reschedule(self) -> None:
        for sid in sorted(self._dirty):
            self._epoch[sid] += 1
            if self.ports[sid].active:
                self._decoding.add(sid)
            else:
                self._decoding.discard(sid)
            t = self.ports[sid].next_finish()
            if t is not None:
                self.queue.push(t, Kind.SLICE, sid, self._epoch[sid])
        self._dirty.clear()

    # ------------------------------------------------------------------ accounting
    def _account(self, t: float) -> None:
        dt = t - self._last
        if dt <= 0:
            return
        if self.trainer_busy:
            self._train_busy_s += dt
            if self.cluster.placement == Placement.COLOCATED:
                self._lent_s += dt
        elif self._decoding:
            self._rollout_only_s += dt
        self._last = t

    def _snapshot(self) -> None:
        now = self.clock.now
        for port in self.ports.values():
            port.settle(now)
        costs = [p.costs for p in self.ports.values()]
        self.snapshots.append(
            Snapshot(
                t=now,
                step=self.steps_done,
                rollout_only_s=self._rollout_only_s,
                train_busy_s=self._train_busy_s,
                colocated_train_s=self._lent_s,
                busy_slot_s=sum(c.busy_slot_s for c in costs),
                tokens=self.tokens_consumed,
                migration_s=sum(c.migration_s for c in costs),
                prefill_tokens=sum(c.prefill_tokens for c in costs),
                weight_loads=sum(c.weight_loads for c in costs),
                coordinator_s=self.coordinator_s,
            )
        )
