"""A simulated rollout slice: the coordinator's `RolloutPort`, decoding on the virtual clock.

The coordinator drives it exactly as it drives a real worker (submit, load_version, export,
import_, progress); what the slice models is time and cost only:
- decode: one step with `a` active requests costs t(a) = t0 + t1 * a seconds and advances each of
  them by one token. The slice keeps a decode clock (steps taken) that advances lazily between
  events at 1 / t(a) steps per second, so a request admitted at clock c with r tokens left
  finishes when the clock reaches c + r. Each request stops at its `forced_length` (the
  workload's drawn response length);
- prefill of a new request (its share of the prompt: the G samples of a prompt share its prefix
  cache), or of prompt + generated tokens after a partial-rollout interrupt: stalls every request
  on the slice;
- load_version: stalls the slice `weight_load_s`;
- an imported SlotState continues with no prefill; the request itself pauses for its KV-cache
  transfer (the other requests keep decoding). With `kv_migration=False` (an ablation) it
  re-prefills prompt share + generated tokens instead;
- lend: a colocated trainer borrows the slice's accelerators; decoding pauses meanwhile and the
  time is not counted as rollout capacity.
Finishes are reported through `finish(now)`, called by the simulator at `next_finish()`; every
request within `chunk_tokens` of its end finishes in the same event, so a paper-scale step costs a
few thousand events, not millions. The versions that sampled a request's tokens are tracked, not
copied from the request, so the ledger's versions_seen shows C1 as it happened.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq
import itertools
from collections.abc import Callable, Sequence
from collections.abc import Sequence as SequenceABC

import numpy as np

from dora_jax.coordinator.ports import Migratable
from dora_jax.core.records import FinishReason, Reprefill, Request, SlotState, Trajectory
from dora_jax.sim.cluster import ClusterSpec

_NO_ARRAY = np.zeros((0, 0, 0, 0), np.float32)  # KV rows and RNG key are not simulated, only their cost
_NO_KEY = np.zeros(2, np.uint32)


class Repeated(SequenceABC):
    """`value` n times in O(1) memory: the token ids and log-probs of a simulated trajectory,
    of which only the count matters (a paper-scale run finishes millions of tokens)."""

    __slots__ = ("_value", "_n")

    def __init__(self, value, n: int):
        self._value, self._n = value, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index):
        if isinstance(index, slice):
            return Repeated(self._value, len(range(self._n)[index]))
        if not -self._n <= index < self._n:
            raise IndexError(index)
        return self._value

    def __iter__(self):
        return itertools.repeat(self._value, self._n)

    # O(1) reductions, which the coordinator's intake checks use where a sequence has them
    # (dora_jax/coordinator/intake.py): the builtins would loop over every simulated token.
    def min(self):
        if not self._n:
            raise ValueError("min() of an empty Repeated")
        return self._value

    max = min

    def sum(self):
        return self._value * self._n


@dataclasses.dataclass
class _Run:
    """One request on this slice (queued or admitted)."""

    request: Request  # without its prefix tuples (the counts below stand for them)
    length: int  # response tokens it finishes at
    arrived: int  # tokens generated before it came here (prefix or SlotState)
    versions: dict[int, int]  # version -> tokens it sampled before it came here (no zero counts)
    prefill: float  # tokens to prefill at admission
    delay: float  # seconds it waits for its KV cache after admission (migration)
    end: float = 0.0  # decode-clock value at which it finishes (admitted runs)
    admitted_t: float | None = None  # when it took a slot here, if it decodes only here (fresh)


class _Queue:
    """A slice's waiting requests in admission order, by id: O(1) to append one, put some first,
    take the first, or take one by id. An export names a few requests among thousands queued, and
    scanning the whole queue for them was the paper command's largest single cost."""

    def __init__(self):
        self._runs: collections.OrderedDict[str, _Run] = collections.OrderedDict()  # admission order
        self._position: dict[str, int] = {}  # increases along the queue
        self._back = self._front = 0

    def __len__(self) -> int:
        return len(self._runs)

    def __iter__(self):
        return iter(self._runs.values())

    def append(self, run: _Run) -> None:
        self._back += 1
        self._insert(run, self._back)

    def put_first(self, runs: Sequence[_Run]) -> None:
        """`runs`, in their order, ahead of everything queued."""
        for run in reversed(runs):
            self._front -= 1
            self._insert(run, self._front)
            self._runs.move_to_end(run.request.traj_id, last=False)

    def popleft(self) -> _Run:
        traj_id, run = self._runs.popitem(last=False)
        del self._position[traj_id]
        return run

    def take(self, traj_ids: Sequence[str]) -> list[_Run]:
        """The queued runs among `traj_ids`, removed, in queue order."""
        hits = sorted((t for t in set(traj_ids) if t in self._runs), key=self._position.__getitem__)
        for traj_id in hits:
            del self._position[traj_id]
        return [self._runs.pop(traj_id) for traj_id in hits]

    def _insert(self, run: _Run, position: int) -> None:
        traj_id = run.request.traj_id
        if traj_id in self._runs:
            raise RuntimeError(f"{traj_id} is queued on this simulated slice already")
        self._runs[traj_id] = run
        self._position[traj_id] = position


@dataclasses.dataclass
class SliceCosts:
    """Cumulative cost counters of one slice."""

    busy_slot_s: float = 0.0  # integral of active requests over time, lent time excluded
    prefill_tokens: float = 0.0
    migration_s: float = 0.0  # KV-transfer seconds of requests imported here
    weight_loads: int = 0


class SimSlice:
    """A `RolloutPort` whose decode runs on the simulator's clock."""

    def __init__(
        self,
        slice_id: int,
        cluster: ClusterSpec,
        *,
        prompt_tokens: int,
        samples_per_prompt: int,
        chunk_tokens: float,
        clock: Callable[[], float],
        on_change: Callable[[SimSlice], None],
        kv_migration: bool = True,
    ):
        self.slice_id = slice_id
        self.num_slots = cluster.slots_per_group
        self._cluster = cluster
        self._t0, self._t1 = cluster.decode.t0_s, cluster.decode.t1_s
        self._prompt_tokens = prompt_tokens
        self._prompt_share = prompt_tokens / samples_per_prompt
        self._chunk = max(float(chunk_tokens), 1e-9)
        self._clock = clock
        self._on_change = on_change  # the simulator re-schedules this slice's next finish
        self._kv_migration = kv_migration
        self.version: int | None = None
        self.costs = SliceCosts()
        self._queued = _Queue()
        self._active: dict[str, _Run] = {}
        self._heap: list[tuple[float, str]] = []  # (end clock, traj id), cleaned lazily
        self._steps = 0.0  # decode clock at _t_last
        self._t_last = 0.0
        self._stall_end = 0.0  # no decoding before this (prefill, weight load, lent)
        self._lent = (0.0, 0.0)  # the latest interval the accelerators were lent to the trainer

    # ------------------------------------------------------------------ the port
    def submit(self, requests: Sequence[Request]) -> None:
        now = self._clock()
        self._settle(now)
        for request in requests:
            self._queued.append(self._run_of(request))
        self._admit(now)

    def load_version(self, version: int) -> None:
        if self._active or self._queued:
            raise RuntimeError(f"simulated slice {self.slice_id}: load_version with requests on it")
        if version == self.version:
            return
        now = self._clock()
        self._settle(now)
        self.version = version
        self._stall_end = max(self._stall_end, now) + self._cluster.weight_load_s
        self.costs.weight_loads += 1

    def export(self, traj_ids: Sequence[str], kv: bool = True) -> list[Migratable]:
        """(`kv` is not modelled: what an import costs is decided at the import.)"""
        now = self._clock()
        self._settle(now)
        out: list[Migratable] = [self._as_request(run) for run in self._queued.take(traj_ids)]
        for traj_id in traj_ids:
            run = self._active.pop(traj_id, None)
            if run is not None:
                out.append(self._slot_state(run))
        self._admit(now)
        return out

    def import_(self, items: Sequence[Migratable]) -> None:
        now = self._clock()
        self._settle(now)
        resumed = []  # they were decoding already: first in line
        for item in items:
            if isinstance(item, Request | Reprefill):
                self._queued.append(self._run_of(item if isinstance(item, Request) else item.request))
                continue
            generated = len(item.response_ids)
            run = self._run_of(item.request, generated, _count_sorted(item.token_versions))
            if self._kv_migration:
                run.prefill = 0.0
                run.delay = self._cluster.migrate_time(self._prompt_tokens + generated)
                self.costs.migration_s += run.delay
            else:
                run.prefill = self._prompt_share + generated
            resumed.append(run)
        self._queued.put_first(resumed)
        self._admit(now)

    def progress(self) -> dict[str, Request]:
        now = self._clock()
        self._settle(now)
        out = {run.request.traj_id: self._as_request(run) for run in self._queued}
        for run in self._active.values():
            out[run.request.traj_id] = self._as_request(run, self._generated(run))
        return out

    # ------------------------------------------------------------------ the simulator's side
    def next_finish(self) -> float | None:
        """When the earliest admitted request finishes, if nothing changes before; None if idle."""
        heap, active = self._heap, self._active
        while heap and (heap[0][1] not in active or active[heap[0][1]].end != heap[0][0]):
            heapq.heappop(heap)
        if not heap:
            return None
        start = max(self._stall_end, self._t_last)
        return start + max(0.0, heap[0][0] - self._steps) * self._step_time(len(active))

    def finish(self, now: float) -> list[Trajectory]:
        """The requests that end by `now` (within a chunk), as trajectories; queued ones move up."""
        self._settle(now)
        limit = self._steps + self._chunk
        done = []
        while self._heap and self._heap[0][0] <= limit:
            end, traj_id = heapq.heappop(self._heap)
            run = self._active.get(traj_id)
            if run is None or run.end != end:
                continue
            del self._active[traj_id]
            done.append(self._trajectory(run, now))
        self._admit(now)
        return done

    def lend(self, now: float, duration: float) -> None:
        """A colocated trainer takes the accelerators for `duration`: decoding pauses."""
        self._settle(now)
        self._stall_end = max(self._stall_end, now) + duration
        self._lent = (now, now + duration)
        self._on_change(self)

    def settle(self, now: float) -> None:
        """Brings the decode clock and the cost counters up to `now`."""
        self._settle(now)

    @property
    def active(self) -> int:
        return len(self._active)

    # ------------------------------------------------------------------ internals
    def _step_time(self, active: int) -> float:
        return self._t0 + self._t1 * active

    def _settle(self, now: float) -> None:
        if now <= self._t_last:
            return
        n = len(self._active)
        if n:
            start = max(self._stall_end, self._t_last)
            if now > start:
                self._steps += (now - start) / self._step_time(n)
            lent = max(0.0, min(now, self._lent[1]) - max(self._t_last, self._lent[0]))
            self.costs.busy_slot_s += n * (now - self._t_last - lent)
        self._t_last = now

    def _run_of(self, request: Request, arrived: int = 0, versions: dict[int, int] | None = None) -> _Run:
        if request.forced_length is None:
            raise ValueError(f"{request.traj_id}: the simulator needs a forced_length (the drawn response length)")
        if request.prefix_response_ids:  # re-dispatched with its tokens so far: re-prefilled
            arrived = len(request.prefix_response_ids)
            versions = _count_sorted(request.prefix_versions)
            request = dataclasses.replace(request, prefix_response_ids=(), prefix_logprobs=(), prefix_versions=())
        length = min(request.forced_length, request.max_new_tokens)
        prefill = self._prompt_share + arrived
        return _Run(request, length, arrived, versions or {}, prefill, 0.0)

    def _admit(self, now: float) -> None:
        """Queued requests take free slots, in order, paying their prefill."""
        while self._queued and len(self._active) < self.num_slots:
            run = self._queued.popleft()
            if run.prefill:
                self._stall_end = max(self._stall_end, now) + run.prefill * self._cluster.prefill_s_per_token
                self.costs.prefill_tokens += run.prefill
                run.prefill = 0.0
            run.end = self._steps + (run.length - run.arrived) + run.delay / self._step_time(len(self._active) + 1)
            run.delay = 0.0
            run.admitted_t = now if run.arrived == 0 else None
            self._active[run.request.traj_id] = run
            heapq.heappush(self._heap, (run.end, run.request.traj_id))
        self._on_change(self)

    def _generated(self, run: _Run) -> int:
        """Tokens an admitted request holds now (settled clock); a request waiting for its KV
        cache has generated nothing here yet."""
        return int(min(run.length, max(run.arrived, run.length - max(0.0, run.end - self._steps))))

    def _seen(self, run: _Run, generated: int) -> dict[int, int]:
        """Tokens per version that sampled them, once `generated` tokens are held (no zero counts)."""
        if generated <= run.arrived:
            return run.versions
        versions = dict(run.versions)
        versions[self.version] = versions.get(self.version, 0) + generated - run.arrived
        return versions

    def _as_request(self, run: _Run, generated: int | None = None) -> Request:
        generated = run.arrived if generated is None else generated
        if not generated:
            return run.request
        versions = _expand(self._seen(run, generated))
        return dataclasses.replace(
            run.request,
            prefix_response_ids=(0,) * generated,
            prefix_logprobs=(0.0,) * generated,
            prefix_versions=versions,
        )

    def _slot_state(self, run: _Run) -> SlotState:
        generated = self._generated(run)
        return SlotState(
            run.request,
            _NO_ARRAY,
            _NO_ARRAY,
            self._prompt_tokens + generated,
            0,
            (0,) * generated,
            (0.0,) * generated,
            _expand(self._seen(run, generated)),
            _NO_KEY,
            self.version,
        )

    def _trajectory(self, run: _Run, now: float) -> Trajectory:
        r = run.request
        seen = self._seen(run, run.length)  # its versions, none with a zero count
        reason = FinishReason.FORCED if run.length == r.forced_length else FinishReason.LENGTH
        return Trajectory(
            r.traj_id,
            r.group_id,
            r.prompt_id,
            r.prompt_ids,
            Repeated(0, run.length),
            Repeated(0.0, run.length),
            r.version,
            tuple(sorted(seen)),
            reason,
            self.slice_id,
            finish_t=now,
            decode_s=now - run.admitted_t if run.admitted_t is not None else 0.0,
        )


def _expand(versions: dict[int, int]) -> tuple[int, ...]:
    """Per-token versions, oldest first (a request only ever moves to newer versions)."""
    return tuple(itertools.chain.from_iterable(itertools.repeat(v, versions[v]) for v in sorted(versions)))


def _count_sorted(versions: Sequence[int]) -> dict[int, int]:
    """Tokens per version of per-token versions in non-decreasing order (what `_expand` makes, and
    so what this simulator's requests carry: a request only ever moves to newer versions), by
    bisection: O(versions x log tokens), where counting each of a long response's tokens at every
    partial-rollout interrupt was a visible share of the paper command's time."""
    counts, start = {}, 0
    while start < len(versions):
        end = bisect.bisect_right(versions, versions[start], start)
        counts[versions[start]] = end - start
        start = end
    return counts
