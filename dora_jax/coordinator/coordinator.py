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

Beside it, one idea a module: the trainer's side, takes and peeks (takes.py), checkpoints
(checkpointing.py, and the JSON's shape in snapshot.py), slice commands that do not idle the loop
(port_calls.py), its settings (config.py) and counters (stats.py), the training groups
(groups.py), rewards (rewards.py), evaluation rounds (evaluation.py), and the pure decisions it
acts on (orchestrator.py, legacy_fill.py, switching.py).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future

from dora_jax.coordinator import (
    dynamic_sampling,
    evaluation,
    events,
    intake,
    legacy_fill,
    orchestrator,
    port_calls,
    switching,
)
from dora_jax.coordinator.checkpointing import Checkpoints
from dora_jax.coordinator.config import CoordinatorConfig
from dora_jax.coordinator.groups import Groups, GroupState
from dora_jax.coordinator.ledger import Ledger
from dora_jax.coordinator.ports import RolloutPort
from dora_jax.coordinator.rewards import Rewards, RewardScorer
from dora_jax.coordinator.stats import CoordinatorStats
from dora_jax.coordinator.takes import TrainerSide
from dora_jax.coordinator.transfer_queue import TransferQueue
from dora_jax.core.modes import Supply, Switch, policy_for
from dora_jax.core.records import Group, Reprefill, Request, ScoredTrajectory, SlotState, Trajectory
from dora_jax.core.window import takes_for_newest


class Coordinator(TrainerSide, Checkpoints):
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
        on_slice_dropped: Callable[[int, str], bool | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        cost_timer: Callable[[], float] = time.perf_counter,
    ):
        """`on_slice_dropped(slice_id, reason)` is told of every slice the coordinator drops, whoever
        found it dead (a failed port call, or a `post_slice_failed`), so that the runner stops its
        worker and restarts it; it runs on the loop thread and must not call back in. It returns
        True when the slice will join again: with every slice down the run then waits for those
        (their requests stay in the backlog) instead of stopping. `clock`
        times the periodic rebalance (a simulator passes its virtual clock); `cost_timer` times
        each switching pass for `switching_s` (wall time; a simulator passes its own CPU time
        less its simulated ports')."""
        config.validate(len(ports))
        self.config = config
        self.policy = policy_for(config.mode)
        self.ports = dict(ports)
        self.ledger = ledger
        self._on_slice_dropped = on_slice_dropped
        self._rejoining: set[int] = set()  # dropped slices their supervisor will start again
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
        self.origin: dict[str, int] = {}  # in flight: the slice each was first sent to (the orchestrator's home)
        self.backlog: list[Request] = []  # dispatched, waiting for a slice serving their version
        self._pace = legacy_fill.Pace()  # observed group and step times (legacy fill's deadlines)
        self._groups = Groups(config, next_prompt, forced_length, clock, self._pace)
        self._latest_counted = -1  # the newest version already counted in max_versions_in_flight
        self.queue = TransferQueue()
        self.stats = CoordinatorStats()
        self.dead: set[int] = set()  # failed slices (their port is gone from self.ports)
        self.draining: dict[int, int] = {}  # slice -> old version it loads once empty (re-dispatches)
        self._redispatch: set[str] = set()  # backlog ids that were dispatched before
        self._failing: dict[int, str] = {}  # slices whose port call failed, handled after the cycle
        self._refused: set[int] = set()  # failing for a result refused at intake: nothing more of theirs counts
        self._peeked: set[str] = set()  # samples a peek showed the trainer (trainer.score_ahead), until taken
        self._committed: tuple[int, set[str]] = (-1, set())  # (trainer version, groups committed to its batch)
        self._evaluation = evaluation.Rounds(config, ledger, self._count_eval)
        self._inbox: queue.SimpleQueue[events.Event] = queue.SimpleQueue()  # C-implemented: a hot path
        # Events taken from the inbox mid-pass that only the loop may apply (`_absorb`, port calls
        # that apply results): applied first by the next `process`, in their order.
        self._held: collections.deque[events.Event] = collections.deque()
        self._apply_during_calls = config.apply_results_during_calls  # dora_jax.coordinator.port_calls
        self._applied_in_calls: set[type] = set()  # kinds of events applied during port calls, for `process`
        self._rewards = Rewards(scorer, self._inbox.put)
        self._filter_budget = dynamic_sampling.FilterBudget(config)  # groups filtered since the last take
        self._replaced = False  # a filtered group was replaced since the last switching pass (sync, one_step_off)
        # A plain lock: `_port_call` releases it around each call, which a re-entrant lock held
        # twice would not do.
        self._cond = threading.Condition(threading.Lock())
        self._last_rebalance = 0.0
        # Seconds (by `cost_timer`) of the latest switching passes (placement, orchestrator,
        # migrations), port calls included: what one rebalance costs the control plane.
        self.switching_s: collections.deque[float] = collections.deque(maxlen=100_000)
        self.closed = False

    @property
    def groups(self) -> dict[str, GroupState]:
        """The training groups in flight (not yet whole in the TransferQueue), by id."""
        return self._groups.by_id

    # ------------------------------------------------------------------ events in
    def post_finished(self, slice_id: int, trajectories: Sequence[Trajectory]) -> None:
        self._inbox.put(events.Finished(slice_id, tuple(trajectories)))

    def post_published(self, version: int) -> None:
        self._inbox.put(events.Published(int(version)))

    def post_slice_failed(self, slice_id: int, reason: str) -> None:
        """A slice died (raised, missed heartbeats, process gone): its requests are re-dispatched
        under their own version to slices serving it."""
        self._inbox.put(events.SliceFailed(slice_id, reason))

    def post_slice_wont_rejoin(self, slice_id: int, reason: str) -> None:
        """A dropped slice whose restart `on_slice_dropped` promised will not join after all: with
        no slice left and none coming, the run stops."""
        self._inbox.put(events.SliceWontRejoin(slice_id, reason))

    def post_slice_joined(self, port: RolloutPort) -> None:
        """A (re)started slice joins with nothing loaded; the next rebalance gives it work."""
        self._inbox.put(events.SliceJoined(port))

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
                dynamic_sampling=cfg.dynamic_sampling,
            )
            self._supply(initial=True)
            self._apply_switching()

    def process(self, timeout: float = 0.0) -> int:
        """Applies pending events (waiting up to `timeout` for the first) and runs the triggers."""
        with self._cond:  # events are taken only under the lock, so `_absorb` sees every one
            # Results applied during the last pass's port calls trigger as if applied here.
            kinds, self._applied_in_calls = self._applied_in_calls, set()
            handled = len(kinds)
            if timeout > 0 and not handled and not self._held and self._inbox.empty():
                self._cond.wait(timeout)  # posters do not notify (they must never block): poll
            while (event := self._next_event()) is not None:
                self._handle(event)
                handled += 1
                kinds.add(type(event))
            # Finishes trigger once per batch of events, not once per event (the hot path).
            new = self._supply() if handled else []  # top up whenever the window allows, not only on a take
            finished = events.Finished in kinds and (self.policy.switch != Switch.ORCHESTRATE or self._pressure())
            if (
                new or finished or self._replaced or self._failing
            ):  # a failing slice (a refused result) is dropped there
                self._replaced = False
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
                self._on_finished(slice_id, trajectories)
            case events.Scored(traj, reward, error):
                self._on_scored(traj, reward, error)
            case events.Published(version):
                self._on_published(version)
            case events.Taken():  # one per step: its batch is dispatched before a later publish re-tags it
                self._supply(after_take=True)
                self._apply_switching()
            case events.SliceFailed(slice_id, reason):
                self._on_slice_failed(slice_id, reason)
            case events.SliceWontRejoin(slice_id, reason):
                self._on_slice_wont_rejoin(slice_id, reason)
            case events.SliceJoined(port):
                self._on_slice_joined(port)
            case events.EvalRequested():
                if requests := self._evaluation.start(event, self.latest):
                    self.backlog += requests
                    self._count_versions_in_flight()
                    self._apply_switching()
            case events.SnapshotRequested(extra, result):
                try:
                    result.set_result(self._snapshot(extra))
                except Exception as err:  # the asking thread gets the error, the loop goes on
                    result.set_exception(err)
            case events.CallDone():
                pass  # a port call's, left in the inbox when an error cut its wait short
            case _:
                raise TypeError(f"unknown coordinator event {event!r}")

    def _next_event(self) -> events.Event | None:
        if self._held:
            return self._held.popleft()
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    # ------------------------------------------------------------------ dispatch
    def _unconsumed(self) -> int:
        return self._groups.samples + self.queue.num_samples

    def _absorb(self) -> None:
        """Applies finished/scored events already in the inbox, without triggers. A worker posts
        what finished before it executes the next command, so after an export returns this makes
        the coordinator's view of that slice exact. Other events are held for `process`, in order."""
        held = []
        while (event := self._next_event()) is not None:
            if isinstance(event, events.Finished | events.Scored):
                self._handle(event)
            else:
                held.append(event)
        self._held.extend(held)

    def _apply_result(self, hold: int | None, event: events.Event) -> None:
        """During a port call (`apply_results_during_calls`): a result is applied, and the
        trainer woken, unless it is slice `hold`'s; any other event is held for `process`."""
        if isinstance(event, events.Scored) or (isinstance(event, events.Finished) and event.slice_id != hold):
            self._handle(event)
            self._applied_in_calls.add(type(event))
            self._cond.notify_all()
        else:
            self._held.append(event)

    def _supply(self, *, initial: bool = False, after_publish: bool = False, after_take: bool = False) -> list[Request]:
        cfg, supply = self.config, self.policy.supply
        unconsumed = self._unconsumed()
        if supply == Supply.BARRIER:  # sync: the next batch only once the last one is trained on
            want = cfg.train_batch_size if (initial or after_publish) and unconsumed == 0 else 0
        elif supply == Supply.ONE_AHEAD:  # one_step_off: the next batch as the trainer takes one
            want = cfg.train_batch_size if (initial or after_take) and unconsumed == 0 else 0
        else:  # streaming: RBS in flight, and never more unconsumed than the takes that may still train on it
            in_flight = len(self.requests) + len(self.backlog) - self._evaluation.unfinished
            want = min(cfg.rollout_batch_size - in_flight, self._takes_for_newest() * cfg.train_batch_size - unconsumed)
        new = []
        for _ in range(max(want, 0) // cfg.group_size):
            group = self._groups.start(self.latest)
            self.backlog += group  # at once: the next group's prompt may forget what no request holds
            new += group
        if new:
            self._count_versions_in_flight()
        return new

    def _takes_for_newest(self) -> int:
        """How many trainer takes may still consume a sample of the newest version (C3: trainer
        versions latest .. latest + K): K + 1 until the trainer has taken at `latest`, K after.
        Everything unconsumed is at most that new, so it must fit in these takes."""
        return takes_for_newest(self.config.window, self._taken_at, self.latest)

    def _send(self, requests: Sequence[Request], slice_id: int) -> None:
        """Dispatches `requests` to the slice: ledger and bookkeeping, then one submit command."""
        self._assign(requests, slice_id)
        if requests:
            self._port_call(slice_id, "submit", list(requests))

    def _assign(self, requests: Sequence[Request], slice_id: int) -> None:
        """A dispatch's bookkeeping and ledger events, without the submit (`_send` does both)."""
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
            is_eval = request.traj_id in self._evaluation
            group = self._groups.sent(request.group_id)
            self._redispatch.discard(request.traj_id)
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
            while self.ports:  # none: every slice is down, the backlog waits for one to join
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
        old = switching.by_old_version(self.backlog, self.latest)
        sent: set[str] = set()
        by_slice: dict[int, list[Request]] = {}
        for version, requests in sorted(old.items()):
            serving = self._serving(version)
            if not serving and version not in self.draining.values():
                empty = [s for s in self.ports if not self.slice_trajs[s] and s not in self.draining]
                reserve = len(old) > 1 or any(r.version == self.latest for r in self.backlog)
                slots = max(self._slots[s] for s in self.ports)
                for sid in switching.to_load(len(requests), empty, slots, reserve):
                    self._load(sid, version)
                if not empty and (sid := switching.to_drain(self.slice_trajs, self.draining)) is not None:
                    self.draining[sid] = version
                    self.ledger.write("drain", slice=sid, for_version=version)
                serving = self._serving(version)
            for request in requests:
                if serving:
                    sid = switching.least_loaded(serving, self.slice_trajs, self._slots)
                    self._assign([request], sid)  # one submit per slice below, as `_switch_idle`
                    by_slice.setdefault(sid, []).append(request)
                    sent.add(request.traj_id)
        if sent:
            self.backlog = [r for r in self.backlog if r.traj_id not in sent]
        for sid, requests in by_slice.items():
            self._port_call(sid, "submit", requests)

    def _serving(self, version: int) -> list[int]:
        return [
            s
            for s in self.ports
            if self.slice_version[s] == version and s not in self.draining and s not in self._failing
        ]

    def _orchestrate(self) -> None:
        self._absorb()
        views = orchestrator.views(self.slice_version, self._slots, self.slice_trajs, self.draining)
        if not views:
            return  # every live slice is draining for an old version
        backlog = {r.traj_id: r for r in self.backlog if r.version == self.latest}
        old = [r for r in self.backlog if r.version != self.latest]  # waiting for a draining slice
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
        self._migrate(orchestrator.still_possible(plan.fills, self.slice_version, self.slice_trajs))

    def _legacy_fill(self, views: Sequence[orchestrator.SliceView], backlog: dict[str, Request]) -> None:
        """Groups at an older version on its slices' idle slots (legacy_fill.py), before the
        orchestrator places `backlog` (the newest version's unsent requests). First whole unsent
        groups that the newest version's slices have no free slot for (they would queue there)
        move to the old version; then new groups, as far as the window allows. Only on slices the
        orchestrator keeps at their version (filling one it would empty would hold it)."""
        g = self.config.group_size
        candidates, newest_free = legacy_fill.candidates(views, self.latest, len(backlog), g, self._failing)
        if not candidates:
            return
        movable = collections.deque(legacy_fill.movable_groups(backlog, self._groups.unsent, newest_free, g))
        now = self._clock()
        fills = legacy_fill.plan(
            candidates,
            latest=self.latest,
            next_take=self.latest + (self._taken_at >= self.latest),
            k=self.config.window,
            train_batch_size=self.config.train_batch_size,
            group_size=g,
            unconsumed=self._groups.unconsumed_by_version(self.queue.versions()),
            now=now,
            pace=self._pace,
            running_ages=self._groups.legacy_ages(now),
            movable_groups=len(movable),
        )
        for sid, count in fills:
            version = self.slice_version[sid]
            for _ in range(count):
                if movable:  # an unsent group of the newest version, re-tagged as a publish re-tags
                    group_id, traj_ids = movable.popleft()
                    self._groups.move_to_legacy(group_id, version)
                    requests = [dataclasses.replace(backlog.pop(t), version=version) for t in traj_ids]
                else:
                    requests = self._groups.start(version, legacy=version != self.latest)
                self._send(requests, sid)
                self.stats.legacy_groups += 1

    def _switch_idle(self) -> None:
        """sync / one_step_off / partial_rollout: a slice loads the newest version only when empty;
        the backlog goes to slices serving its version, least loaded first."""
        if any(r.version == self.latest for r in self.backlog):
            for sid in switching.idle_behind(self.slice_version, self.slice_trajs, self.draining, self.latest):
                self._load(sid, self.latest)
        remaining = []
        serving: dict[int, switching.LeastLoaded] = {}  # per version, for this pass (loads only grow)
        # One submit per slice for the whole pass: a submit returns once the worker has queued it,
        # at its next step boundary, so a submit per request spread a sync batch of 64 over ~0.3 s
        # of decode steps (the last requests started that much later) and the worker then
        # prefilled them one at a time instead of together.
        by_slice: dict[int, list[Request]] = {}
        for request in self.backlog:
            if request.version not in serving:
                slices = self._serving(request.version)
                serving[request.version] = switching.LeastLoaded(slices, self.slice_trajs, self._slots, self._failing)
            sid = serving[request.version].pick()
            if sid is None:
                remaining.append(request)
                continue
            self._assign([request], sid)
            by_slice.setdefault(sid, []).append(request)
        self.backlog = remaining
        for sid, requests in by_slice.items():
            self._port_call(sid, "submit", requests)

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
        start, err = self._clock(), None
        try:
            if self._apply_during_calls and method in port_calls.CALLS:
                hold = slice_id if method == "import_" else None  # its results follow the migrate lines
                apply = functools.partial(self._apply_result, hold)
                result, err = port_calls.call(port, method, args, self._inbox, self._cond, apply)
            else:
                self._cond.release()  # never hold the lock across I/O (the trainer's take waits on it)
                try:
                    result = getattr(port, method)(*args)
                except Exception as raised:
                    err = raised
                finally:
                    self._cond.acquire()
        finally:
            waits = self.stats.port_wait_s
            waits[method] = waits.get(method, 0.0) + self._clock() - start
        if err is not None:
            self._failing[slice_id] = f"{method} failed: {type(err).__name__}: {err}"
            return default
        return True if result is None else result

    def _on_slice_failed(self, slice_id: int, reason: str) -> None:
        if slice_id in self.ports:
            self._failing.setdefault(slice_id, reason)
            self._apply_switching()

    def _on_slice_wont_rejoin(self, slice_id: int, reason: str) -> None:
        if slice_id in self._rejoining:
            self._rejoining.discard(slice_id)
            self._check_a_slice_is_left(slice_id, reason)

    def _check_a_slice_is_left(self, slice_id: int, reason: str) -> None:
        """The run stops when no slice is live and none is coming back."""
        if not self.ports and not self._rejoining:
            raise RuntimeError(f"every rollout slice has failed (last: slice {slice_id}: {reason})")

    def _drop_slice(self, slice_id: int, reason: str) -> None:
        """Removes a dead slice; what it held goes back to the backlog under its own version."""
        self._absorb()  # what it finished before dying counts (unless it was refused a result)
        self._failing.pop(slice_id, None)  # after: a result refused in that absorb fails it again
        self._refused.discard(slice_id)  # from here on, being dead, nothing it posts counts
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
        if self._on_slice_dropped is not None and self._on_slice_dropped(slice_id, reason):
            self._rejoining.add(slice_id)
        self._check_a_slice_is_left(slice_id, reason)

    def _on_slice_joined(self, port: RolloutPort) -> None:
        sid = port.slice_id
        if sid in self.ports:
            raise ValueError(f"slice {sid} joined but is already live")
        self.ports[sid] = port
        self._slots[sid] = port.num_slots
        self.dead.discard(sid)
        self._rejoining.discard(sid)
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
            moved = []
            for item in items:
                request = item if isinstance(item, Request) else item.request
                traj_id, version = request.traj_id, request.version
                if self.slice_version[dst] != version:
                    raise RuntimeError(
                        f"{traj_id} (v{version}) routed to slice {dst} serving v{self.slice_version[dst]}"
                    )
                del self.slice_trajs[src][traj_id]
                self.slice_trajs[dst][traj_id] = None
                self.slice_of[traj_id] = dst
                how = "kv" if isinstance(item, SlotState) else "reprefill" if isinstance(item, Reprefill) else "queued"
                moved.append((traj_id, version, how))
            imported = self._port_call(dst, "import_", items) if items else None
            # A slot sent with its KV that the destination could not pull was re-prefilled there.
            reprefilled = set(imported) if isinstance(imported, list | tuple) else set()
            for traj_id, version, how in moved:
                how = "reprefill" if how == "kv" and traj_id in reprefilled else how
                self.stats.migrations_kv += how == "kv"
                self.stats.migrations_reprefill += how == "reprefill"
                self.stats.migrations_queued += how == "queued"
                self.ledger.write(
                    "migrate", traj=traj_id, **{"from": src, "to": dst}, version=version, kv=how == "kv", how=how
                )

    def _pressure(self) -> bool:
        """Work waits for a slice (the backlog, or `orchestrator.under_pressure`)."""
        return bool(self.backlog) or orchestrator.under_pressure(
            self.slice_version, self.slice_trajs, self._slots, self.latest
        )

    # ------------------------------------------------------------------ partial rollout
    def _interrupt_all(self) -> None:
        """At a publish, every in-flight request continues on the new version after re-prefill."""
        for sid in list(self.ports):
            items = self._port_call(sid, "export", list(self.slice_trajs[sid]), False, default=[])  # no KV
            self._absorb()
            if sid in self._failing:
                continue  # dropped at the end of the cycle: what it holds is re-dispatched
            requests = [switching.continuation(item) for item in items]
            for request in requests:
                del self.slice_trajs[sid][request.traj_id]
            if self.slice_version[sid] != self.latest and not self._load(sid, self.latest):
                # Re-dispatched when the slice is dropped.
                self.slice_trajs[sid].update(dict.fromkeys(r.traj_id for r in requests))
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
    def _on_finished(self, slice_id: int, trajectories: Sequence[Trajectory]) -> None:
        """A slice's post of finished trajectories: all of it counts, or, when one result fails
        intake (dora_jax.coordinator.intake), none of it, and the slice fails."""
        if slice_id not in self.ports or slice_id in self._refused:
            for traj in trajectories:  # re-dispatched already: its new run is the one that counts
                self.stats.late_finishes += 1
                self.ledger.write("late_finish", traj=str(traj.traj_id)[: intake.MAX_SHOWN_CHARS], slice=slice_id)
            return
        results = self._intake(slice_id, trajectories)
        if isinstance(results, str):
            self.stats.result_violations += 1
            self._refused.add(slice_id)
            self._failing.setdefault(slice_id, f"refused its result: {results}")  # dropped at the end of the cycle
            return
        for traj in results:
            self._finish(slice_id, traj)

    def _intake(self, slice_id: int, trajectories: Sequence[Trajectory]) -> list[Trajectory] | str:
        """The post's trajectories as they enter the run, or why it is refused: each must be one
        this slice holds (dispatched to it, not finished), once, and pass `intake.check`."""
        newest = self.slice_version[slice_id] if self.policy.keeps_c1 else self.latest
        out: list[Trajectory] = []
        ids: set[str] = set()
        for traj in trajectories:
            traj_id = traj.traj_id
            request = self.requests.get(traj_id) if isinstance(traj_id, str) else None
            if request is None:
                return f"{intake.shown(traj_id)} is not in flight (never dispatched, or finished already)"
            if self.slice_of[traj_id] != slice_id:
                return f"{intake.shown(traj_id)} was dispatched to slice {self.slice_of[traj_id]}, not this one"
            if traj_id in ids:
                return f"{intake.shown(traj_id)} twice in one post"
            ids.add(traj_id)
            problem = intake.check(traj, request, newest_version=newest, vocab_size=self.config.vocab_size)
            if problem:
                return f"{intake.shown(traj_id)}: {problem}"
            out.append(intake.accepted(traj, request, slice_id))
        return out

    def _finish(self, slice_id: int, traj: Trajectory) -> None:
        """Books a result that passed intake: it leaves the slice, enters its group, is scored."""
        self.requests.pop(traj.traj_id)
        del self.slice_of[traj.traj_id]
        self.origin.pop(traj.traj_id, None)
        del self.slice_trajs[slice_id][traj.traj_id]
        is_eval = traj.traj_id in self._evaluation
        if is_eval:
            self.stats.eval_finished += 1
            self._evaluation.unfinished -= 1
        else:
            self.stats.finished += 1
            self._groups.finished(traj)
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
        self._rewards.submit(traj)

    def _on_scored(self, traj: Trajectory, reward: float, error: str | None) -> None:
        self._rewards.received(traj)
        if traj.traj_id in self._evaluation:
            self._evaluation.scored(traj, reward, error)
            return
        group = self._groups.scored(ScoredTrajectory(traj, float(reward), error))
        if error:
            self.stats.reward_failures += 1
            self.ledger.write("reward_error", traj=traj.traj_id, error=error)
        if group is not None:
            self._completed(group)

    def _completed(self, group: Group) -> None:
        """A training group is whole and scored: its rewards go to the ledger; with dynamic sampling
        a group without reward variance is filtered and replaced (dynamic_sampling.py), the rest
        enter the TransferQueue."""
        self.stats.scored_groups += 1
        self.ledger.write("score", **dynamic_sampling.score_event(group, self.config.reward_on_error))
        why = (
            dynamic_sampling.why_filtered(group, self.config.reward_on_error) if self.config.dynamic_sampling else None
        )
        if why is None:
            self.queue.put(group)
            return
        self.stats.filtered_groups += 1
        self.stats.filtered_samples += len(group.samples)
        trajs = [s.trajectory.traj_id for s in group.samples]
        self._peeked.difference_update(trajs)  # never taken
        self.ledger.write("filtered", group=group.group_id, version=group.version, why=why, trajs=trajs)
        self._filter_budget.spend(self._taken_at)
        if self.policy.supply != Supply.STREAM:  # streaming modes: `_supply` tops up by itself
            # Not `_apply_switching` here: this may run inside one (`_absorb`); `process` runs it next.
            self.backlog += self._groups.start(self.latest)
            self._count_versions_in_flight()
            self._replaced = True

    def _count_eval(self) -> None:
        self.stats.evals += 1  # told by `Rounds` as a round completes (`restore` replaces `stats`)

    def _on_published(self, version: int) -> None:
        if version <= self.latest:
            raise ValueError(f"published version {version} is not newer than {self.latest}")
        self.latest = version
        self._pace.published(self._clock())
        self.ledger.write("publish", version=version, step=version)
        # Whole groups that were never sent (no dispatch line yet) move to the newest version,
        # where new work belongs. The rest of the backlog keeps its version (C1): requests put back
        # from a dead slice or restored from a checkpoint, and groups partly sent already.
        self.backlog = self._groups.retag_unsent(self.backlog, version)
        self._count_versions_in_flight()
        if self.policy.switch == Switch.INTERRUPT:
            self._interrupt_all()
        self._supply(after_publish=True)
        self._apply_switching()
