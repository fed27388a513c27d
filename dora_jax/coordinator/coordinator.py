"""The host-side coordinator: dispatch, scoring, the TransferQueue, the version window, and the
mode's switching policy (DORA's orchestrator, idle switching, or partial-rollout interrupts).

Plain Python over records and ports: it imports no JAX. Everything that happens is written to
the ledger. Thread model: worker threads, reward callbacks, the transport and the trainer only
`post` typed events (dora_jax.coordinator.events) into the inbox; one thread (the runner's
coordinator loop, or a test) calls `process()`, which applies them and runs the rebalancing
triggers. The trainer thread calls `take_batch`, which takes from the TransferQueue under the lock
and posts a `Taken` event: what follows a take runs on the loop, so the trainer thread never calls
a port. Port calls (submit, export, import, load, progress) are made with the lock released, so a
slow or hung slice never holds up the trainer's take; only the loop thread changes the slices'
state, so what it planned under the lock still holds when the call returns.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Protocol

from dora_jax.coordinator import evaluation, events, legacy_fill, orchestrator
from dora_jax.coordinator.ledger import Ledger
from dora_jax.coordinator.ports import RolloutPort
from dora_jax.coordinator.transfer_queue import TransferQueue
from dora_jax.core import records
from dora_jax.core.modes import Supply, Switch, policy_for
from dora_jax.core.records import FinishReason, Group, Request, SamplingParams, ScoredTrajectory, SlotState, Trajectory
from dora_jax.core.window import staleness_bound, takes_for_newest, window_allows


@dataclasses.dataclass(frozen=True)
class CoordinatorConfig:
    mode: str = "dora"
    k_max: int = 2
    rollout_batch_size: int = 32  # RBS: samples kept in flight in streaming modes (<= (k_max + 1) * TBS)
    train_batch_size: int = 16  # TBS: samples per training step
    group_size: int = 4  # G samples per prompt
    max_new_tokens: int = 64
    sampling: SamplingParams = SamplingParams()
    stop_ids: tuple[int, ...] = ()
    seed: int = 0
    rebalance_period_s: float = 0.5  # periodic trigger
    # dora: new groups at an older version fill that version's idle slots while the trainer can
    # still consume them within C3 (dora_jax/coordinator/legacy_fill.py)
    legacy_fill: bool = False

    def validate(self, num_slices: int) -> None:
        """Rejects inconsistent settings, naming the field."""
        policy = policy_for(self.mode)
        if self.group_size < 1:
            raise ValueError(f"coordinator.group_size={self.group_size}; expected >= 1")
        if self.train_batch_size % self.group_size:
            raise ValueError(
                f"coordinator.train_batch_size={self.train_batch_size} is not a multiple of "
                f"coordinator.group_size={self.group_size}"
            )
        if self.rollout_batch_size % self.group_size:
            raise ValueError(
                f"coordinator.rollout_batch_size={self.rollout_batch_size} is not a multiple of "
                f"coordinator.group_size={self.group_size}"
            )
        if policy.supply == Supply.STREAM:
            if self.k_max < 1:
                raise ValueError(f"coordinator.k_max={self.k_max}; mode {self.mode} needs k_max >= 1")
            if self.rollout_batch_size < self.train_batch_size:
                raise ValueError(
                    f"coordinator.rollout_batch_size={self.rollout_batch_size} < train_batch_size="
                    f"{self.train_batch_size}; mode {self.mode} keeps at least one batch in flight"
                )
            if self.rollout_batch_size > (self.k_max + 1) * self.train_batch_size:
                raise ValueError(
                    f"coordinator.rollout_batch_size={self.rollout_batch_size} exceeds (k_max + 1) * "
                    f"train_batch_size={(self.k_max + 1) * self.train_batch_size}: the version window never lets "
                    "more samples than K + 1 steps can train on be unconsumed, so it could never be reached"
                )
        if num_slices < 1:
            raise ValueError(f"rollout.num_slices={num_slices}; expected >= 1")
        if self.legacy_fill and policy.switch != Switch.ORCHESTRATE:
            raise ValueError(f"coordinator.legacy_fill=True needs mode dora (the orchestrator), got mode {self.mode}")

    @property
    def window(self) -> int:
        return staleness_bound(self.mode, self.k_max)


class RewardScorer(Protocol):
    def submit(self, trajectory: Trajectory) -> Future[tuple[float, str | None]]:
        """Scores off the critical path; resolves to (reward, error or None)."""


@dataclasses.dataclass
class _GroupState:
    version: int
    size: int
    scored: dict = dataclasses.field(default_factory=dict)
    dispatched_at: float | None = None  # clock at its first dispatch (for legacy fill's pace)
    longest_s: float = 0.0  # the longest run time of its finished samples (legacy fill's pace)
    legacy: bool = False  # started at an older version by legacy fill


@dataclasses.dataclass
class CoordinatorStats:
    dispatched: int = 0
    finished: int = 0
    consumed: int = 0
    migrations_kv: int = 0
    migrations_queued: int = 0
    interrupts: int = 0
    rebalances: int = 0
    switches: int = 0
    reward_failures: int = 0
    slice_failures: int = 0
    redispatched: int = 0
    late_finishes: int = 0  # finished on a slice already declared dead (re-dispatched meanwhile)
    trainer_wait_s: float = 0.0
    max_versions_in_flight: int = 0
    eval_dispatched: int = 0  # evaluation requests (counted apart from the training samples above)
    eval_finished: int = 0
    evals: int = 0  # evaluation rounds completed
    legacy_groups: int = 0  # groups started at an older version by legacy fill


class Coordinator:
    def __init__(
        self,
        config: CoordinatorConfig,
        ports: Mapping[int, RolloutPort],
        next_prompt: Callable[[], tuple[str, Sequence[int]]],
        scorer: RewardScorer,
        ledger: Ledger,
        *,
        forced_length: Callable[[str, int], int | None] | None = None,
        initial_version: int = 0,
        on_slice_dropped: Callable[[int, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        cost_timer: Callable[[], float] = time.perf_counter,
    ):
        """`on_slice_dropped(slice_id, reason)` is told of every slice the coordinator drops, whoever
        found it dead (a failed port call, or a `post_slice_failed`), so that the runner stops its
        worker and restarts it; it runs on the loop thread and must not call back in. `clock`
        times the periodic rebalance (a simulator passes its virtual clock); `cost_timer` times
        each switching pass for `switching_s` (wall time; a simulator passes its own CPU time
        less its simulated ports')."""
        config.validate(len(ports))
        self.config = config
        self.policy = policy_for(config.mode)
        self.ports = dict(ports)
        self._next_prompt = next_prompt
        self._scorer = scorer
        self.ledger = ledger
        self._forced_length = forced_length
        self._on_slice_dropped = on_slice_dropped
        self._clock = clock
        self._cost_timer = cost_timer
        self.latest = initial_version  # newest published version
        self._taken_at = initial_version - 1  # trainer version of the last take
        self._slots = {sid: port.num_slots for sid, port in self.ports.items()}  # read once: a hot path
        self.slice_version: dict[int, int | None] = {sid: None for sid in self.ports}
        # Per slice, the ids it holds in dispatch order (a dict as an ordered set: O(1) removal on finish).
        self.slice_trajs: dict[int, dict[str, None]] = {sid: {} for sid in self.ports}
        self.requests: dict[str, Request] = {}  # in flight (dispatched, not finished)
        self.slice_of: dict[str, int] = {}
        self.origin: dict[str, int] = {}
        self.backlog: list[Request] = []  # dispatched, waiting for a slice serving their version
        self.groups: dict[str, _GroupState] = {}
        self._group_samples = 0  # sum of the sizes of `groups` (kept, not recounted: a hot path)
        self._latest_counted = -1  # the newest version already counted in max_versions_in_flight
        self.queue = TransferQueue()
        self.stats = CoordinatorStats()
        self.unscored: dict[str, Trajectory] = {}  # finished, reward not back yet
        self.dead: set[int] = set()  # failed slices (their port is gone from self.ports)
        self.draining: dict[int, int] = {}  # slice -> old version it loads once empty (re-dispatches)
        self._redispatch: set[str] = set()  # backlog ids that were dispatched before
        self._unsent: set[str] = set()  # groups none of whose requests was ever sent: only these may be re-tagged
        self._failing: dict[int, str] = {}  # slices whose port call failed, handled after the cycle
        self._evals: dict[str, evaluation.EvalRound] = {}  # evaluation rounds not yet complete
        self._eval_of: dict[str, str] = {}  # evaluation trajectory -> its round
        self._eval_unfinished = 0  # evaluation requests dispatched or waiting, not finished
        self._next_eval = 0
        self._inbox: queue.SimpleQueue[events.Event] = queue.SimpleQueue()  # C-implemented: a hot path
        # A plain lock: `_port_call` releases it around each call, which a re-entrant lock held
        # twice would not do.
        self._cond = threading.Condition(threading.Lock())
        self._next_group = 0
        self._last_rebalance = 0.0
        self._pace = legacy_fill.Pace()  # observed group and step times (legacy fill's deadlines)
        # Seconds (by `cost_timer`) of the latest switching passes (placement, orchestrator,
        # migrations), port calls included: what one rebalance costs the control plane.
        self.switching_s: collections.deque[float] = collections.deque(maxlen=100_000)
        self.closed = False

    # ------------------------------------------------------------------ events in
    def post_finished(self, slice_id: int, trajectories: Sequence[Trajectory]) -> None:
        self._inbox.put(events.Finished(slice_id, tuple(trajectories)))

    def post_published(self, version: int) -> None:
        self._inbox.put(events.Published(int(version)))

    def post_slice_failed(self, slice_id: int, reason: str) -> None:
        """A slice died (raised, missed heartbeats, process gone): its requests are re-dispatched
        under their own version to slices serving it."""
        self._inbox.put(events.SliceFailed(slice_id, reason))

    def post_slice_joined(self, port: RolloutPort) -> None:
        """A (re)started slice joins with nothing loaded; the next rebalance gives it work."""
        self._inbox.put(events.SliceJoined(port))

    def request_snapshot(self, extra: Callable[[], dict] | None = None) -> Future[dict]:
        """`snapshot()` taken by the loop thread (it calls the ports); for other threads."""
        future: Future = Future()
        self._inbox.put(events.SnapshotRequested(extra, future))
        return future

    def request_eval(
        self, version: int, step: int, prompts: Sequence[tuple[str, Sequence[int]]], samples: int
    ) -> Future[dict]:
        """Evaluates `version` (the newest once the publishes posted before this are applied) on
        `prompts` through the slices: one greedy and `samples` sampled responses each. The future
        resolves to the round's summary (dora_jax.coordinator.evaluation) plus `responses`, a list
        of (Trajectory, reward, error). Evaluation never enters a training batch."""
        future: Future = Future()
        frozen = tuple((str(pid), tuple(int(t) for t in ids)) for pid, ids in prompts)
        self._inbox.put(events.EvalRequested(int(version), int(step), frozen, int(samples), future))
        return future

    def record_behaviour(self, step: int, digests: Mapping[int, str]) -> None:
        """Ledger: the params (by digest) the trainer used at `step` to recompute behaviour
        log-probs, per version, so the audit can match them with what the slices loaded."""
        self.ledger.write("behaviour", step=int(step), digests={str(v): d for v, d in sorted(digests.items())})

    def start(self) -> None:
        """Writes the run's header to the ledger and dispatches at the initial version."""
        with self._cond:
            cfg = self.config
            self.ledger.write(
                "run",
                mode=cfg.mode,
                k_max=cfg.window,
                rbs=cfg.rollout_batch_size,
                tbs=cfg.train_batch_size,
                group_size=cfg.group_size,
                slices=len(self.ports),
            )
            self._supply(initial=True)
            self._apply_switching()

    def process(self, timeout: float = 0.0) -> int:
        """Applies pending events (waiting up to `timeout` for the first) and runs the triggers."""
        handled, kinds = 0, set()
        with self._cond:  # events are taken only under the lock, so `_absorb` sees every one
            if timeout > 0 and self._inbox.empty():
                self._cond.wait(timeout)  # posters do not notify (they must never block): poll
            try:
                event = self._inbox.get_nowait()
            except queue.Empty:
                event = None
            while event is not None:
                self._handle(event)
                handled += 1
                kinds.add(type(event))
                try:
                    event = self._inbox.get_nowait()
                except queue.Empty:
                    event = None
            # Finishes trigger once per batch of events, not once per event (the hot path).
            new = self._supply() if handled else []  # top up whenever the window allows, not only on a take
            finished = events.Finished in kinds and (self.policy.switch != Switch.ORCHESTRATE or self._pressure())
            if new or finished:
                self._apply_switching()  # pressure trigger; idle slices may switch and take the backlog
            if (
                self.policy.switch == Switch.ORCHESTRATE
                and self._clock() - self._last_rebalance > self.config.rebalance_period_s
            ):
                self._apply_switching()  # periodic trigger
            self._cond.notify_all()
        self.ledger.flush_if_due()
        return handled

    def _handle(self, event: events.Event) -> None:
        """The one place events are dispatched (with the lock held, on the loop thread)."""
        match event:
            case events.Finished(slice_id, trajectories):
                for traj in trajectories:
                    self._on_finished(slice_id, traj)
            case events.Scored(traj, reward, error):
                self._on_scored(traj, reward, error)
            case events.Published(version):
                self._on_published(version)
            case events.Taken():  # one per step: its batch is dispatched before a later publish re-tags it
                self._supply(after_take=True)
                self._apply_switching()
            case events.SliceFailed(slice_id, reason):
                self._on_slice_failed(slice_id, reason)
            case events.SliceJoined(port):
                self._on_slice_joined(port)
            case events.EvalRequested():
                self._on_eval_requested(event)
            case events.SnapshotRequested(extra, result):
                try:
                    result.set_result(self._snapshot(extra))
                except Exception as err:  # the asking thread gets the error, the loop goes on
                    result.set_exception(err)
            case _:
                raise TypeError(f"unknown coordinator event {event!r}")

    # ------------------------------------------------------------------ dispatch
    def _unconsumed(self) -> int:
        return self._group_samples + self.queue.num_samples

    def _absorb(self) -> None:
        """Applies finished/scored events already in the inbox, without triggers. A worker posts
        what finished before it executes the next command, so after an export returns this makes
        the coordinator's view of that slice exact. Publishes are put back for `process`."""
        deferred = []
        while True:
            try:
                event = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(event, events.Finished):
                for traj in event.trajectories:
                    self._on_finished(event.slice_id, traj)
            elif isinstance(event, events.Scored):
                self._on_scored(event.trajectory, event.reward, event.error)
            else:
                deferred.append(event)
        for event in deferred:
            self._inbox.put(event)

    def _supply(self, *, initial: bool = False, after_publish: bool = False, after_take: bool = False) -> list[Request]:
        cfg, supply = self.config, self.policy.supply
        unconsumed = self._unconsumed()
        if supply == Supply.BARRIER:  # sync: the next batch only once the last one is trained on
            want = cfg.train_batch_size if (initial or after_publish) and unconsumed == 0 else 0
        elif supply == Supply.ONE_AHEAD:  # one_step_off: the next batch as the trainer takes one
            want = cfg.train_batch_size if (initial or after_take) and unconsumed == 0 else 0
        else:  # streaming: RBS in flight, and never more unconsumed than the takes that may still train on it
            in_flight = len(self.requests) + len(self.backlog) - self._eval_unfinished
            want = min(cfg.rollout_batch_size - in_flight, self._takes_for_newest() * cfg.train_batch_size - unconsumed)
        new = []
        for _ in range(max(want, 0) // cfg.group_size):
            new += self._new_group()
        self.backlog += new
        if new:
            self._count_versions_in_flight()
        return new

    def _takes_for_newest(self) -> int:
        """How many trainer takes may still consume a sample of the newest version (C3: trainer
        versions latest .. latest + K): K + 1 until the trainer has taken at `latest`, K after.
        Everything unconsumed is at most that new, so it must fit in these takes."""
        return takes_for_newest(self.config.window, self._taken_at, self.latest)

    def _new_group(self, version: int | None = None) -> list[Request]:
        """A new prompt's G requests, at the newest version unless `version` says otherwise."""
        cfg = self.config
        version = self.latest if version is None else version
        group_id = f"g{self._next_group}"
        self._next_group += 1
        prompt_id, prompt_ids = self._next_prompt()
        self.groups[group_id] = _GroupState(version, cfg.group_size, legacy=version != self.latest)
        self._group_samples += cfg.group_size
        self._unsent.add(group_id)
        requests = []
        for i in range(cfg.group_size):
            traj_id = f"{group_id}/{i}"
            sampling = records.request_sampling(cfg.sampling, cfg.seed, traj_id)
            forced = self._forced_length(prompt_id, i) if self._forced_length else None
            requests.append(
                Request(
                    traj_id,
                    group_id,
                    str(prompt_id),
                    tuple(int(t) for t in prompt_ids),
                    version,
                    cfg.max_new_tokens,
                    sampling,
                    tuple(cfg.stop_ids),
                    forced,
                )
            )
        return requests

    def _send(self, requests: Sequence[Request], slice_id: int) -> None:
        for request in requests:
            if request.version != self.slice_version[slice_id]:
                raise RuntimeError(
                    f"{request.traj_id} (v{request.version}) sent to slice {slice_id} "
                    f"serving v{self.slice_version[slice_id]}"
                )
            self.requests[request.traj_id] = request
            self.slice_of[request.traj_id] = slice_id
            self.origin.setdefault(request.traj_id, slice_id)
            self.slice_trajs[slice_id][request.traj_id] = None
            again = request.traj_id in self._redispatch
            is_eval = request.traj_id in self._eval_of
            group = self.groups.get(request.group_id)
            if group is not None and group.dispatched_at is None:
                group.dispatched_at = self._clock()
            self._redispatch.discard(request.traj_id)
            self._unsent.discard(request.group_id)
            self.ledger.write(
                "dispatch",
                traj=request.traj_id,
                group=request.group_id,
                prompt=request.prompt_id,
                version=request.version,
                slice=slice_id,
                **({"redispatch": True} if again else {}),
                **({"eval": True} if is_eval else {}),
                **({"legacy": True} if group is not None and group.legacy else {}),
                **({"prefix_tokens": len(request.prefix_response_ids)} if request.prefix_response_ids else {}),
            )
            if is_eval:
                self.stats.eval_dispatched += not again
            else:
                self.stats.dispatched += not again
            self.stats.redispatched += again
        if requests:
            self._port_call(slice_id, "submit", list(requests))

    def _count_versions_in_flight(self) -> None:
        """Called where the set can grow (new groups, a publish's re-tag); a send only moves a
        request from the backlog to a slice. Once the newest version is in it, the set only
        shrinks until the next publish."""
        if self._latest_counted == self.latest:
            return
        versions = self.versions_in_flight()
        self.stats.max_versions_in_flight = max(self.stats.max_versions_in_flight, len(versions))
        if self.latest in versions:
            self._latest_counted = self.latest

    def versions_in_flight(self) -> set[int]:
        return {r.version for r in self.requests.values()} | {r.version for r in self.backlog}

    def versions_needed(self) -> set[int]:
        """Every version something may still read: in-flight or unconsumed samples (for the
        trainer's behaviour recompute), the versions slices serve and those draining slices will
        load."""
        with self._cond:
            needed = self.versions_in_flight() | set(self.queue.versions())
            needed |= {g.version for g in self.groups.values()} | set(self.draining.values())
            return needed | {v for v in self.slice_version.values() if v is not None}

    # ------------------------------------------------------------------ switching policies
    def _apply_switching(self) -> None:
        self._last_rebalance = self._clock()
        start = self._cost_timer()
        try:
            while True:
                self._place_old_versions()
                if self.policy.switch == Switch.ORCHESTRATE:
                    self._orchestrate()
                else:
                    self._switch_idle()
                if not self._failing:
                    return
                for sid, reason in list(self._failing.items()):
                    self._drop_slice(sid, reason)
        finally:
            self.switching_s.append(self._cost_timer() - start)

    def _place_old_versions(self) -> None:
        """Backlog requests of an older version (re-dispatched off a failed slice, or resumed from a
        checkpoint) go to a slice serving their version, C1 first. Without one, empty slices load
        it (one per `num_slots` requests); if none is empty, the least-loaded slice takes no new
        work until it is, then loads it."""
        for sid, version in list(self.draining.items()):
            if sid in self.ports and not self.slice_trajs[sid]:
                del self.draining[sid]
                self._load(sid, version)
        old: dict[int, list[Request]] = {}
        for request in self.backlog:
            if request.version != self.latest:
                old.setdefault(request.version, []).append(request)
        sent: set[str] = set()
        for version, requests in sorted(old.items()):
            serving = self._serving(version)
            if not serving and version not in self.draining.values():
                empty = [s for s in self.ports if not self.slice_trajs[s] and s not in self.draining]
                reserve = 1 if len(old) > 1 or any(r.version == self.latest for r in self.backlog) else 0
                slots = max(self._slots[s] for s in self.ports)
                wanted = max(1, min(-(-len(requests) // slots), len(empty) - reserve))
                for sid in empty[:wanted]:
                    self._load(sid, version)
                if not empty:
                    candidates = [s for s in self.ports if s not in self.draining]
                    if candidates:
                        sid = min(candidates, key=lambda s: (len(self.slice_trajs[s]), s))
                        self.draining[sid] = version
                        self.ledger.write("drain", slice=sid, for_version=version)
                serving = self._serving(version)
            for request in requests:
                if serving:
                    sid = min(serving, key=lambda s: (len(self.slice_trajs[s]) / self._slots[s], s))
                    self._send([request], sid)
                    sent.add(request.traj_id)
        if sent:
            self.backlog = [r for r in self.backlog if r.traj_id not in sent]

    def _serving(self, version: int) -> list[int]:
        return [
            s
            for s in self.ports
            if self.slice_version[s] == version and s not in self.draining and s not in self._failing
        ]

    def _views(self) -> list[orchestrator.SliceView]:
        return [
            orchestrator.SliceView(sid, self.slice_version[sid], self._slots[sid], tuple(self.slice_trajs[sid]))
            for sid in self.ports
            if sid not in self.draining
        ]

    def _orchestrate(self) -> None:
        self._absorb()
        views = self._views()
        if not views:
            return  # every live slice is draining for an old version
        backlog, old = {}, []  # old: waiting for a draining slice
        for r in self.backlog:
            if r.version == self.latest:
                backlog[r.traj_id] = r
            else:
                old.append(r)
        if self.config.legacy_fill:
            self._legacy_fill(views, backlog)
        plan = orchestrator.plan_rebalance(views, self.latest, list(backlog), self.origin)
        self.stats.rebalances += 1
        self._migrate(plan.migrations)
        for sid, version in plan.switches:
            if sid in self.ports and not self.slice_trajs[sid]:  # else something landed or stayed: C1 first
                self._load(sid, version)
        by_slice: dict[int, list[Request]] = {}
        for traj_id, sid in plan.placements:
            if self.slice_version.get(sid) == self.latest and sid not in self._failing:
                by_slice.setdefault(sid, []).append(backlog.pop(traj_id))
        self.backlog = old + list(backlog.values())
        for sid, requests in sorted(by_slice.items()):
            self._send(requests, sid)
        self._migrate(
            [
                m
                for m in plan.fills
                if m.src in self.ports
                and m.dst in self.ports
                and self.slice_version[m.src] == self.slice_version[m.dst]
                and m.traj_id in self.slice_trajs[m.src]
            ]
        )

    def _legacy_fill(self, views: Sequence[orchestrator.SliceView], backlog: dict[str, Request]) -> None:
        """Groups at an older version on its slices' idle slots (legacy_fill.py), before the
        orchestrator places `backlog` (the newest version's unsent requests). First whole unsent
        groups that the newest version's slices have no free slot for (they would queue there)
        move to the old version; then new groups, as far as the window allows. Only on slices the
        orchestrator keeps at their version (filling one it would empty would hold it)."""
        g = self.config.group_size
        loads: collections.Counter[int] = collections.Counter({self.latest: len(backlog)})
        newest_free, old = 0, {}
        for view in views:
            if view.version is not None:
                loads[view.version] += len(view.trajs)
            if view.version == self.latest:
                newest_free += max(view.free, 0)
            elif not view.trajs:
                newest_free += view.num_slots  # the orchestrator switches it to the newest version
            elif view.version is not None and view.free >= g and view.slice_id not in self._failing:
                old.setdefault(view.version, []).append(view)
        targets = orchestrator.target_partition(loads, len(views), self.latest)
        candidates = [
            legacy_fill.OldSlice(v.slice_id, v.version, v.free)
            for version, members in old.items()
            if len(members) <= targets.get(version, 0)
            for v in members
        ]
        if not candidates:
            return
        ids_of: dict[str, list[str]] = {}  # unsent newest groups -> their ids in the backlog, in order
        for traj_id, r in backlog.items():
            if r.group_id in self._unsent:
                ids_of.setdefault(r.group_id, []).append(traj_id)
        movable = collections.deque(list(ids_of)[: max(len(backlog) - newest_free, 0) // g])
        unconsumed: collections.Counter[int] = collections.Counter()
        for version in self.queue.versions():
            unconsumed[version] += g
        now, ages = self._clock(), []
        for group in self.groups.values():
            unconsumed[group.version] += group.size
            if group.legacy and group.dispatched_at is not None:
                ages.append(now - group.dispatched_at)  # admitted at dispatch: its age is run time
        fills = legacy_fill.plan(
            candidates,
            latest=self.latest,
            next_take=self.latest + (self._taken_at >= self.latest),
            k=self.config.window,
            train_batch_size=self.config.train_batch_size,
            group_size=g,
            unconsumed=unconsumed,
            now=now,
            pace=self._pace,
            running_ages=ages,
            movable_groups=len(movable),
        )
        for sid, groups in fills:
            version = self.slice_version[sid]
            for _ in range(groups):
                if movable:  # an unsent group of the newest version, re-tagged as a publish re-tags
                    group_id = movable.popleft()
                    self.groups[group_id].version, self.groups[group_id].legacy = version, True
                    requests = [dataclasses.replace(backlog.pop(t), version=version) for t in ids_of[group_id]]
                else:
                    requests = self._new_group(version)
                self._send(requests, sid)
                self.stats.legacy_groups += 1

    def _switch_idle(self) -> None:
        """sync / one_step_off / partial_rollout: a slice loads the newest version only when empty;
        the backlog goes to slices serving its version, least loaded first."""
        for sid in list(self.ports):
            if (
                sid not in self.draining
                and not self.slice_trajs[sid]
                and self.slice_version[sid] != self.latest
                and any(r.version == self.latest for r in self.backlog)
            ):
                self._load(sid, self.latest)
        remaining = []
        for request in self.backlog:
            serving = self._serving(request.version)
            if not serving:
                remaining.append(request)
                continue
            sid = min(serving, key=lambda s: (len(self.slice_trajs[s]) / self._slots[s], s))
            self._send([request], sid)
        self.backlog = remaining

    def _load(self, slice_id: int, version: int) -> bool:
        if slice_id in self._failing:
            return False
        if self.slice_trajs[slice_id]:
            raise RuntimeError(f"slice {slice_id} still holds {list(self.slice_trajs[slice_id])[:3]}; cannot switch")
        digest = self._port_call(slice_id, "load_version", version)
        if not digest:
            return False
        self.slice_version[slice_id] = version
        self.stats.switches += 1
        self.ledger.write(
            "load_version", slice=slice_id, version=version, **({"digest": digest} if isinstance(digest, str) else {})
        )
        return True

    def _port_call(self, slice_id: int, method: str, *args, default=None):
        """Calls a port. A slice that fails a call is marked failing (later calls to it are
        skipped) and dropped at the end of the cycle, its requests re-dispatched (C2): a dead
        slice is never a crash of the run. Returns the result (True for None), or `default`."""
        if slice_id in self._failing:
            return default
        port = self.ports[slice_id]
        self._cond.release()  # never hold the lock across I/O (the trainer's take waits on it)
        try:
            result = getattr(port, method)(*args)
        except Exception as err:
            self._failing[slice_id] = f"{method} failed: {type(err).__name__}: {err}"
            return default
        finally:
            self._cond.acquire()
        return True if result is None else result

    def _on_slice_failed(self, slice_id: int, reason: str) -> None:
        if slice_id in self.ports:
            self._failing.setdefault(slice_id, reason)
            self._apply_switching()

    def _drop_slice(self, slice_id: int, reason: str) -> None:
        """Removes a dead slice; what it held goes back to the backlog under its own version."""
        self._failing.pop(slice_id, None)
        self._absorb()  # what it finished before dying counts
        del self.ports[slice_id]
        self.dead.add(slice_id)
        self.draining.pop(slice_id, None)
        self.slice_version.pop(slice_id)
        lost = list(self.slice_trajs.pop(slice_id))
        self.stats.slice_failures += 1
        self.ledger.write("slice_failed", slice=slice_id, reason=reason, requests=len(lost))
        for traj_id in lost:
            request = self.requests.pop(traj_id)
            self.slice_of.pop(traj_id)
            self.origin.pop(traj_id, None)
            self.backlog.append(request)
            self._redispatch.add(traj_id)
        if self._on_slice_dropped is not None:
            self._on_slice_dropped(slice_id, reason)
        if not self.ports:
            raise RuntimeError(f"every rollout slice has failed (last: slice {slice_id}: {reason})")

    def _on_slice_joined(self, port: RolloutPort) -> None:
        sid = port.slice_id
        if sid in self.ports:
            raise ValueError(f"slice {sid} joined but is already live")
        self.ports[sid] = port
        self._slots[sid] = port.num_slots
        self.dead.discard(sid)
        self.slice_version[sid] = None
        self.slice_trajs[sid] = {}
        self.ledger.write("slice_joined", slice=sid)
        self._apply_switching()

    def _migrate(self, migrations: Sequence[orchestrator.Migration]) -> None:
        by_route: dict[tuple[int, int], list[str]] = {}
        for m in migrations:
            by_route.setdefault((m.src, m.dst), []).append(m.traj_id)
        for (src, dst), traj_ids in by_route.items():
            if dst in self._failing:
                continue
            items = self._port_call(src, "export", traj_ids, default=[])
            self._absorb()  # ids missing from `items` finished before the export
            for item in items:
                traj_id = item.request.traj_id if isinstance(item, SlotState) else item.traj_id
                version = item.request.version if isinstance(item, SlotState) else item.version
                if self.slice_version[dst] != version:
                    raise RuntimeError(
                        f"{traj_id} (v{version}) routed to slice {dst} serving v{self.slice_version[dst]}"
                    )
                del self.slice_trajs[src][traj_id]
                self.slice_trajs[dst][traj_id] = None
                self.slice_of[traj_id] = dst
                kv = isinstance(item, SlotState)
                self.stats.migrations_kv += kv
                self.stats.migrations_queued += not kv
                self.ledger.write("migrate", traj=traj_id, **{"from": src, "to": dst}, version=version, kv=kv)
            if items:
                self._port_call(dst, "import_", items)

    def _pressure(self) -> bool:
        """A slice has queued work while a same-version slice has free slots, or an old-version
        slice sits empty while newer work waits."""
        if self.backlog:
            return True
        # One pass (it runs on every batch of finishes; thousands of slices at pod scale): the
        # versions with a slice that has a free slot; an over-full slice is never one of them.
        free = {self.slice_version[o] for o in self.ports if len(self.slice_trajs[o]) < self._slots[o]}
        for sid, trajs in self.slice_trajs.items():
            v = self.slice_version[sid]
            if (len(trajs) > self._slots[sid] and v in free) or (not trajs and v != self.latest):
                return True
        return False

    # ------------------------------------------------------------------ partial rollout
    def _interrupt_all(self) -> None:
        """At a publish, every in-flight request continues on the new version after re-prefill."""
        for sid in list(self.ports):
            items = self._port_call(sid, "export", list(self.slice_trajs[sid]), default=[])
            self._absorb()
            if sid in self._failing:
                continue  # dropped at the end of the cycle: what it holds is re-dispatched
            for item in items:
                del self.slice_trajs[sid][item.request.traj_id if isinstance(item, SlotState) else item.traj_id]
            requests = [_as_request(item) for item in items]
            if self.slice_version[sid] != self.latest and not self._load(sid, self.latest):
                self.slice_trajs[sid].update(
                    dict.fromkeys(r.traj_id for r in requests)
                )  # re-dispatched when the slice is dropped
                continue
            for request in requests:
                self.stats.interrupts += 1
                self.ledger.write(
                    "interrupt",
                    traj=request.traj_id,
                    version=request.version,
                    to_version=self.latest,
                    tokens=len(request.prefix_response_ids),
                    slice=sid,
                )
                self.slice_trajs[sid][request.traj_id] = None
            if requests:
                self._port_call(sid, "import_", requests)

    # ------------------------------------------------------------------ results
    def _on_finished(self, slice_id: int, traj: Trajectory) -> None:
        if slice_id in self.dead or self.slice_of.get(traj.traj_id, slice_id) != slice_id:
            self.stats.late_finishes += 1  # re-dispatched already: its new run is the one that counts
            self.ledger.write("late_finish", traj=traj.traj_id, slice=slice_id)
            return
        if traj.traj_id not in self.requests:
            raise RuntimeError(f"slice {slice_id} finished unknown trajectory {traj.traj_id}")
        self.requests.pop(traj.traj_id)
        sid = self.slice_of.pop(traj.traj_id)
        del self.slice_trajs[sid][traj.traj_id]
        is_eval = traj.traj_id in self._eval_of
        if is_eval:
            self.stats.eval_finished += 1
            self._eval_unfinished -= 1
        else:
            self.stats.finished += 1
            group = self.groups.get(traj.group_id)
            if group is not None and group.dispatched_at is not None:
                # Decode time where the worker measured it, else (migrated) dispatch to finish here.
                run_s = traj.decode_s if traj.decode_s > 0 else self._clock() - group.dispatched_at
                group.longest_s = max(group.longest_s, run_s)
        self.ledger.write(
            "finish",
            traj=traj.traj_id,
            version=traj.version,
            versions_seen=list(traj.versions_seen),
            tokens=traj.num_tokens,
            reason=traj.finish_reason.value,
            slice=slice_id,
            **({"eval": True} if is_eval else {}),
            **({"error": traj.error} if traj.error else {}),
        )
        self._score(traj)

    def _score(self, traj: Trajectory) -> None:
        self.unscored[traj.traj_id] = traj
        if traj.finish_reason == FinishReason.REJECTED:
            self._inbox.put(events.Scored(traj, 0.0, f"rejected: {traj.error}"))
            return
        future = self._scorer.submit(traj)
        future.add_done_callback(lambda f, t=traj: self._inbox.put(events.Scored(t, *_result(f))))

    def _on_scored(self, traj: Trajectory, reward: float, error: str | None) -> None:
        if self.unscored.pop(traj.traj_id, None) is None:
            raise RuntimeError(f"{traj.traj_id} scored but not awaiting a reward")
        if traj.traj_id in self._eval_of:
            self._on_eval_scored(traj, reward, error)
            return
        group = self.groups[traj.group_id]
        group.scored[traj.traj_id] = ScoredTrajectory(traj, float(reward), error)
        if error:
            self.stats.reward_failures += 1
            self.ledger.write("reward_error", traj=traj.traj_id, error=error)
        if len(group.scored) == group.size:
            del self.groups[traj.group_id]
            if group.dispatched_at is not None:
                self._pace.group_done(group.longest_s)
            self._group_samples -= group.size
            samples = tuple(group.scored[k] for k in sorted(group.scored, key=lambda k: int(k.rsplit("/", 1)[1])))
            self.queue.put(Group(traj.group_id, group.version, samples))

    def _on_published(self, version: int) -> None:
        if version <= self.latest:
            raise ValueError(f"published version {version} is not newer than {self.latest}")
        self.latest = version
        self._pace.published(self._clock())
        self.ledger.write("publish", version=version, step=version)
        # Whole groups that were never sent (no dispatch line yet) move to the newest version,
        # where new work belongs. The rest of the backlog keeps its version (C1): requests put back
        # from a dead slice or restored from a checkpoint, and groups partly sent already.
        self.backlog = [
            dataclasses.replace(r, version=version) if r.group_id in self._unsent else r for r in self.backlog
        ]
        for group_id in self._unsent:
            self.groups[group_id].version = version
        self._count_versions_in_flight()
        if self.policy.switch == Switch.INTERRUPT:
            self._interrupt_all()
        self._supply(after_publish=True)
        self._apply_switching()

    # ------------------------------------------------------------------ evaluation
    def _on_eval_requested(self, event: events.EvalRequested) -> None:
        if event.version > self.latest:
            event.result.set_exception(ValueError(f"evaluation of version {event.version}: newest is {self.latest}"))
            return
        round_id = f"e{self._next_eval}"
        self._next_eval += 1
        cfg = self.config
        requests = evaluation.make_requests(
            round_id,
            event.version,
            event.prompts,
            event.samples,
            max_new_tokens=cfg.max_new_tokens,
            sampling=cfg.sampling,
            stop_ids=tuple(cfg.stop_ids),
            seed=cfg.seed,
        )
        run = evaluation.EvalRound(round_id, event.version, event.step, len(event.prompts), event.samples, event.result)
        self.ledger.write("eval_start", round=round_id, version=event.version, step=event.step, requests=len(requests))
        if not requests:
            self._eval_done(run)
            return
        self._evals[round_id] = run
        for request in requests:
            self._eval_of[request.traj_id] = round_id
        self._eval_unfinished += len(requests)
        self.backlog += requests
        self._count_versions_in_flight()
        self._apply_switching()

    def _on_eval_scored(self, traj: Trajectory, reward: float, error: str | None) -> None:
        run = self._evals[self._eval_of[traj.traj_id]]
        run.add(traj, float(reward), error)
        if error:
            self.ledger.write("reward_error", traj=traj.traj_id, error=error, eval=True)
        if run.done:
            del self._evals[run.round_id]
            for traj_id in run.scored:
                del self._eval_of[traj_id]
            self._eval_done(run)

    def _eval_done(self, run: evaluation.EvalRound) -> None:
        summary = run.summary()
        self.stats.evals += 1
        self.ledger.write("eval", round=run.round_id, **summary)
        responses = [run.scored[k] for k in sorted(run.scored)]
        run.result.set_result({**summary, "responses": responses})

    # ------------------------------------------------------------------ checkpoints
    def snapshot(self, extra: Callable[[], dict] | None = None) -> dict:
        """The coordinator's state as JSON, consistent with the ledger's first `ledger_offset`
        lines. In-flight requests carry their tokens so far (the ports' `progress`) as a prefix;
        finished groups, partly scored groups and trajectories awaiting a reward are kept whole.
        `extra()` runs under the same lock (the prompt source's position: it advances only here).
        It calls the ports: only the thread that runs `process()` may call it; any other thread
        uses `request_snapshot()`."""
        with self._cond:
            return self._snapshot(extra)

    def _snapshot(self, extra: Callable[[], dict] | None) -> dict:
        self._absorb()
        progress: dict[str, Request] = {}
        for sid in list(self.ports):
            if hasattr(self.ports[sid], "progress"):
                progress.update(self._port_call(sid, "progress", default={}) or {})
        # Nothing below releases the lock: the state and the ledger offset are read together.
        self.ledger.flush()  # the offset counts only lines in the file
        extra_state = extra() if extra else {}
        # Evaluation requests are not saved: a round in flight at a checkpoint is lost with the process.
        dispatched = [
            progress.get(t, r) if progress.get(t, r).version == r.version else r
            for t, r in self.requests.items()
            if t not in self._eval_of
        ]
        return {
            "latest": self.latest,
            "next_group": self._next_group,
            "next_eval": self._next_eval,  # round ids stay unique across a resume
            "dispatched": [records.request_to_json(r) for r in dispatched],
            "backlog": [records.request_to_json(r) for r in self.backlog if r.traj_id not in self._eval_of],
            "redispatch": sorted(t for t in self._redispatch if t not in self._eval_of),
            "groups": {
                gid: {
                    "version": g.version,
                    "size": g.size,
                    "scored": [records.scored_to_json(x) for x in g.scored.values()],
                }
                for gid, g in self.groups.items()
            },
            "unscored": [records.trajectory_to_json(t) for k, t in self.unscored.items() if k not in self._eval_of],
            "queue": [records.group_to_json(g) for g in self.queue.peek_oldest(len(self.queue))],
            "stats": dataclasses.asdict(self.stats),
            "ledger_offset": self.ledger.lines_written,
            "extra": extra_state,
        }

    def restore(self, state: dict | None) -> None:
        """Continues from `snapshot()`, before `start()` and with nothing loaded on the slices:
        writes the ledger's `resume` event (voiding what the lost process wrote after the
        snapshot), re-dispatches in-flight requests under their own version, re-scores. With no
        state (a run that died before its first checkpoint) everything before is voided."""
        with self._cond:
            if state is None:
                self.ledger.write(
                    "resume",
                    ledger_offset=0,
                    version=self.latest,
                    in_flight=0,
                    backlog=0,
                    unconsumed_groups=0,
                    prefix_tokens=0,
                )
                return
            self.latest = int(state["latest"])
            self._taken_at = self.latest  # not known: assume taken, the smaller window (never more than C3 allows)
            self._next_group = int(state["next_group"])
            self._next_eval = int(state.get("next_eval", 0))
            for gid, g in state["groups"].items():
                scored = [records.scored_from_json(x) for x in g["scored"]]
                self.groups[gid] = _GroupState(
                    int(g["version"]), int(g["size"]), {x.trajectory.traj_id: x for x in scored}
                )
                self._group_samples += int(g["size"])
            for g in state["queue"]:
                self.queue.put(records.group_from_json(g))
            self.stats = CoordinatorStats(**state["stats"])
            dispatched = [records.request_from_json(r) for r in state["dispatched"]]
            self.backlog = dispatched + [records.request_from_json(r) for r in state["backlog"]]
            self._redispatch = set(state["redispatch"]) | {r.traj_id for r in dispatched}
            self.ledger.write(
                "resume",
                ledger_offset=int(state["ledger_offset"]),
                version=self.latest,
                in_flight=len(dispatched),
                backlog=len(state["backlog"]),
                unconsumed_groups=len(self.queue) + len(self.groups),
                prefix_tokens=sum(len(r.prefix_response_ids) for r in dispatched),
            )
            for data in state["unscored"]:
                self._score(records.trajectory_from_json(data))

    def wait_for_version(self, version: int, timeout: float = 60.0) -> None:
        """Blocks until the publish of `version` has been applied (the event loop runs it)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.latest < version:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"coordinator did not apply the publish of version {version} within {timeout}s")
                self._cond.wait(0.05)

    # ------------------------------------------------------------------ trainer side
    def try_take_batch(self, trainer_version: int) -> list[Group] | None:
        """TBS samples, oldest version first, if the version window lets the trainer advance from
        `trainer_version` to `trainer_version + 1`; None otherwise. Caller holds no lock."""
        with self._cond:
            if trainer_version != self.latest:
                return None  # its publish is still in the inbox: supplies would use a stale version
            need = self.config.train_batch_size // self.config.group_size
            if len(self.queue) < need:
                return None
            rest: collections.Counter[int] = collections.Counter()
            for v in itertools.islice(self.queue.versions(), need, None):
                rest[v] += self.config.group_size
            for g in self.groups.values():
                rest[g.version] += g.size
            if not window_allows(rest, trainer_version, self.config.window, self.config.train_batch_size):
                return None  # older trajectories are still unconsumed: wait for them (never drop them)
            batch = self.queue.take_oldest(need)
            self._taken_at = trainer_version
            for group in batch:
                for sample in group.samples:
                    self.ledger.write(
                        "consume",
                        traj=sample.trajectory.traj_id,
                        group=group.group_id,
                        version=sample.trajectory.version,
                        step=trainer_version,
                        trainer_version=trainer_version,
                    )
                    self.stats.consumed += 1
            self._inbox.put(events.Taken(trainer_version))  # supply and switching follow on the loop
            return batch

    def take_batch(
        self, trainer_version: int, timeout: float | None = None, cancel: threading.Event | None = None
    ) -> list[Group] | None:
        """Blocks until `try_take_batch` succeeds; the wait is added to stats.trainer_wait_s.
        None once the coordinator is closed or `cancel` is set (nothing is taken then)."""
        start = time.monotonic()
        while True:
            batch = self.try_take_batch(trainer_version)
            if batch is not None or self.closed or (cancel is not None and cancel.is_set()):
                self.stats.trainer_wait_s += time.monotonic() - start
                return batch
            if timeout is not None and time.monotonic() - start > timeout:
                raise TimeoutError(f"no batch for trainer version {trainer_version} after {timeout}s")
            with self._cond:
                self._cond.wait(0.05)


def _as_request(item) -> Request:
    if isinstance(item, Request):
        return item
    r = item.request
    return dataclasses.replace(
        r,
        prefix_response_ids=tuple(item.response_ids),
        prefix_logprobs=tuple(item.logprobs),
        prefix_versions=tuple(item.token_versions),
    )


def _result(future: Future) -> tuple[float, str | None]:
    try:
        reward, error = future.result()
    except Exception as err:  # the scorer itself failed: mask the sample, keep the run
        return 0.0, f"scorer error: {type(err).__name__}: {err}"
    return reward, error
