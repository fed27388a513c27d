"""The per-slice continuous-batching worker: Requests in, Trajectories out, one params version at a time.

A `RolloutWorker` owns one `RolloutEngine` (one rollout slice) and its decode state. It is a
synchronous object: one thread calls it. Each `step()` admits queued requests into free slots
(prefill + insert), runs one `generate` over all slots, and returns the trajectories that finished.
The version of the params used by every call is recorded per token, so `versions_seen` of a
trajectory is what actually produced it, not what it was dispatched with.

Migration: `export_requests` removes in-flight requests as `SlotState`s (KV rows, position, RNG
key, tokens, log-probs, per-token versions); `import_requests` on a worker serving the same version
continues them with no prefill. Queued, not yet admitted requests leave with `take_queued()` as
plain Requests. A Request with `prefix_response_ids` (re-dispatch after a failure, or partial
rollout) is re-prefilled on prompt + prefix and continues; `as_redispatch(slot_state)` builds one.

Pipelined (the default, as JetStream's orchestrator overlaps with `copy_to_host_async`): `step()`
dispatches this step's `generate` before it reads the previous step's tokens, so the host's
bookkeeping (appending tokens, finishing, admitting) runs while the device computes, and between
calls one decode step is in flight. The host record then lags the device by that step, and every
effect is ordered by which decode state each program consumes (`generate` and `insert` donate it):
- A slot's tokens go to the record that occupied it when the step was dispatched; a record that
  finished (EOS, stop) or left (export) meanwhile drops them: its slot computed one garbage token.
- A record whose last token is already in flight (its length is known in advance: forced or
  max_new_tokens) is not fed again, and its slot is refilled at once: the insert consumes the
  state after that last step, which therefore still computes the old occupant's token.
- A request admitted after step N's dispatch lands in the state of step N + 1; its first token
  (from prefill) is read with step N's tokens.
- An export takes the record as it stands (its last accepted token pending at position p) with
  KV rows 0..p-1, which the step in flight (writing row p) leaves unchanged; the device's newer
  token is dropped and recomputed at the destination (sampling is counter-based per position: the
  same token). So no trajectory ends inside an export: what finished before it was posted first.
- `load_version` waits for the steps in flight (they use the old params) before it frees them;
  their tokens keep the version that was dispatched with them (an export right after a switch
  with `allow_active` drops such a token: the destination samples it with the new version, and
  records so).
`pipelined=False` reads every step's tokens before `step()` returns (one host round trip per
step). `bench engine` measures both against the bare decode step.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import numpy as np

from dora_jax.core.records import FinishReason, Reprefill, Request, SlotState, Trajectory
from dora_jax.rollout import migration as migration_rule
from dora_jax.rollout.engine import PrefillRequest, ResultTokens, RolloutEngine, check_sampling
from dora_jax.rollout.migration import MigrationCosts
from dora_jax.rollout.scoring import TrajectoryScorer
from dora_jax.store.digest import params_digest

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WorkerCounters:
    """Cumulative counts; occupancy = active slot-steps / slot-steps."""

    decode_steps: int = 0
    slot_steps: int = 0  # decode_steps x num_slots
    idle_slot_steps: int = 0  # slot-steps spent on empty slots
    prefills: int = 0
    prefill_tokens: int = 0  # true (unpadded) tokens prefilled
    shared_prompt_tokens: int = 0  # prompt tokens a group's later samples took from pages already held, not prefilled
    prefill_batches: int = 0  # batched prefill programs (several requests each)
    generated_tokens: int = 0  # tokens sampled by prefill and generate
    imports: int = 0
    exports: int = 0
    finished: int = 0
    rejected: int = 0
    preemptions: int = 0  # requests sent back to the queue when the KV page pool ran dry
    scored: int = 0  # finished trajectories scored with the training forward (trainer.behaviour_logps = "rollout")
    score_failures: int = 0  # finished trajectories posted unscored because the scoring failed

    @property
    def occupancy(self) -> float:
        return 1.0 - self.bubble_ratio if self.slot_steps else 0.0

    @property
    def bubble_ratio(self) -> float:
        return self.idle_slot_steps / self.slot_steps if self.slot_steps else 0.0


@dataclasses.dataclass(eq=False)
class _Active:
    """Host-side record of one admitted request (compared by identity)."""

    request: Request
    response_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    dispatch_t: float
    num_migrations: int = 0
    slot: int = -1
    admit_t: float | None = None  # when it took its slot here (None: imported, decoded elsewhere too)
    in_flight: int = 0  # its tokens dispatched (prefill or generate) and not yet read
    closed: bool = False  # finished or exported: its tokens still in flight are dropped
    seq: int = 0  # admission order on this worker (the youngest is preempted first)

    @property
    def needs_tokens(self) -> bool:
        """Whether the next decode step should feed it: open, and its length limit not reached by
        the tokens already read and in flight (EOS or a stop id may still end it earlier)."""
        request = self.request
        limit = request.max_new_tokens if request.forced_length is None else request.forced_length
        return not self.closed and len(self.response_ids) + self.in_flight < limit


@dataclasses.dataclass(frozen=True)
class _Unread:
    """Tokens a dispatched program samples, not yet read: row i goes to `records[i]` (None: to
    nobody), with the params version the program ran with."""

    result: ResultTokens
    records: tuple[_Active | None, ...]
    version: int
    decode_step: bool  # a generate (counted in decode_steps) or a prefill's first token


def as_redispatch(state: SlotState) -> Request:
    """The Request that resumes `state` by re-prefill (prompt + tokens so far), e.g. on a worker
    serving another version (partial rollout) or after the source slice failed."""
    return dataclasses.replace(
        state.request,
        prefix_response_ids=state.response_ids,
        prefix_logprobs=state.logprobs,
        prefix_versions=state.token_versions,
    )


class RolloutWorker:
    """Continuous batching over one engine; `eos_ids` default to the model config's."""

    def __init__(
        self,
        engine: RolloutEngine,
        *,
        slice_id: int = 0,
        eos_ids: Sequence[int] | None = None,
        clock: Callable[[], float] = time.time,
        pipelined: bool = True,
        migration: MigrationCosts | None = None,
        batched_prefill: bool = True,
        scorer: TrajectoryScorer | None = None,
    ):
        """`pipelined`: dispatch each decode step before reading the previous one's tokens (see the
        module docstring); False reads every step's tokens before `step()` returns. `migration`:
        the costs that decide whether an exported request leaves with its KV or to be re-prefilled
        (`migration_choice`); it takes the engine's measured prefill times. `batched_prefill`: admit
        several waiting requests by batched prefills (False: one prefill and insert each).
        `scorer` (trainer.behaviour_logps = "rollout"): scores the trajectories each step finishes
        with the training forward under this worker's version (`_scored`); None: not scored."""
        self._engine = engine
        self.pipelined = pipelined
        self.batched_prefill = batched_prefill
        self.migration = migration or MigrationCosts()
        self.migration.prefill_seconds = engine.prefill_seconds
        self.slice_id = slice_id
        self._eos = frozenset(engine.model_config.eos_ids if eos_ids is None else eos_ids)
        self._clock = clock
        self._state = engine.init_decode_state()
        self._params = None
        self._version: int | None = None
        self._digest: str | None = None  # of the loaded params: it travels with every scored trajectory
        self.scorer = scorer
        self._slots: list[_Active | None] = [None] * engine.max_concurrent_decodes
        self._queue: collections.deque[tuple[Request, float]] = collections.deque()
        self._rejected: list[Trajectory] = []
        self._unread: collections.deque[_Unread] = collections.deque()
        self._tally: collections.Counter[str] = collections.Counter()
        self._seq = 0

    # ------------------------------------------------------------------ state
    @property
    def engine(self) -> RolloutEngine:
        return self._engine

    @property
    def version(self) -> int | None:
        return self._version

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    @property
    def num_active(self) -> int:
        return sum(record is not None for record in self._slots)

    @property
    def num_free_slots(self) -> int:
        return self.num_slots - self.num_active

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def active_traj_ids(self) -> tuple[str, ...]:
        return tuple(record.request.traj_id for record in self._slots if record is not None)

    @property
    def queued_traj_ids(self) -> tuple[str, ...]:
        return tuple(request.traj_id for request, _ in self._queue)

    @property
    def has_work(self) -> bool:
        return bool(self.num_active or self._queue or self._rejected)

    @property
    def counters(self) -> WorkerCounters:
        """A snapshot of the cumulative counts."""
        return WorkerCounters(**self._tally)

    def _count(self, **increments: int) -> None:
        self._tally.update(increments)

    # ------------------------------------------------------------------ versions
    def load_version(self, version: int, params, *, allow_active: bool = False) -> str:
        """Serves `version` from now on; returns the loaded params' digest (for the ledger's
        audit). Refused while requests are in flight unless `allow_active` (partial rollout:
        in-flight requests continue on the new params, and say so in versions_seen)."""
        if self.num_active and not allow_active:
            raise RuntimeError(
                f"worker {self.slice_id}: {self.num_active} requests are active on version {self._version}; "
                f"finish or export them before loading version {version}, or pass allow_active=True"
            )
        self.block_until_ready()  # the steps in flight still read the old params
        self._params = None  # free the old version first: never two full copies on the slice
        self._params = self._engine.load_params(params)
        self._version = int(version)
        self._digest = params_digest(self._params)
        return self._digest

    # ------------------------------------------------------------------ requests in
    def submit(self, request: Request) -> None:
        """Queues `request`; a bad one comes back from the next `step()` as a REJECTED trajectory."""
        self._check_new_id(request.traj_id)
        now = self._clock()
        problem = self._validate(request)
        if problem:
            self._count(rejected=1)
            self._rejected.append(
                self._trajectory(
                    _Active(
                        request,
                        list(request.prefix_response_ids),
                        list(request.prefix_logprobs),
                        list(request.prefix_versions),
                        now,
                    ),
                    FinishReason.REJECTED,
                    error=problem,
                )
            )
            return
        self._queue.append((request, now))

    def _check_new_id(self, traj_id: str) -> None:
        if traj_id in self.active_traj_ids or traj_id in self.queued_traj_ids:
            raise ValueError(f"traj_id {traj_id!r} is already on worker {self.slice_id}")

    def _validate(self, request: Request, *, prefill: bool = True) -> str | None:
        """An error naming the bad field and value, or None."""
        cfg, vocab = self._engine.config, self._engine.model_config.vocab_size
        prefix = request.prefix_response_ids
        limit = request.max_new_tokens if request.forced_length is None else request.forced_length
        checks = (
            (request.max_new_tokens < 1, f"max_new_tokens={request.max_new_tokens}; expected >= 1"),
            (
                request.forced_length is not None and not 1 <= request.forced_length <= request.max_new_tokens,
                f"forced_length={request.forced_length}; expected 1..max_new_tokens={request.max_new_tokens}",
            ),
            (not request.prompt_ids, "prompt_ids is empty"),
            (
                len(request.prompt_ids) + request.max_new_tokens > cfg.cache_length,
                f"max_new_tokens={request.max_new_tokens} with {len(request.prompt_ids)} prompt tokens exceeds "
                f"cache_length={cfg.cache_length}",
            ),
            (
                not len(prefix) == len(request.prefix_logprobs) == len(request.prefix_versions),
                f"prefix_response_ids has {len(prefix)} tokens but prefix_logprobs {len(request.prefix_logprobs)} "
                f"and prefix_versions {len(request.prefix_versions)}",
            ),
            (len(prefix) >= limit, f"prefix_response_ids has {len(prefix)} tokens; the request stops at {limit}"),
        )
        for failed, message in checks:
            if failed:
                return message
        if prefill:
            try:
                cfg.prefill_chunks(len(request.prompt_ids) + len(prefix))
            except ValueError as err:
                return f"prompt_ids has {len(request.prompt_ids)} tokens (+{len(prefix)} prefix_response_ids): {err}"
        for field in ("prompt_ids", "prefix_response_ids"):
            bad = [t for t in getattr(request, field) if not 0 <= t < vocab]
            if bad:
                return f"{field} holds token id {bad[0]} outside the vocabulary [0, {vocab})"
        return check_sampling(request.sampling, filters=cfg.sampling_filters)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[Trajectory]:
        """One loop iteration: admit queued requests into free slots, dispatch one generate over all
        slots, read the tokens dispatched before it (pipelined) or all of them; returns the
        trajectories that finished (and any rejected at submit)."""
        finished, self._rejected = self._rejected, []
        if (self._queue or self.num_active) and self._params is None:
            raise RuntimeError(f"worker {self.slice_id} has no params; call load_version first")
        self._admit()
        if self.pipelined:
            dispatched = self._dispatch()
            finished += self._read()  # the last step's tokens and the first tokens, while this step runs
            self._unread.extend(dispatched)
        else:
            finished += self._read()  # first tokens: a request may end on its first
            self._unread.extend(self._dispatch())
            finished += self._read()
        return self._scored(finished)

    def _scored(self, finished: list[Trajectory]) -> list[Trajectory]:
        """With a scorer: every finished trajectory that this worker's version alone sampled
        (C1, which makes the scoring exact) carries its behaviour log-probs, all scored in one
        batched forward (dispatched after this step's decode: it runs while the host reads). The
        rest (rejected, empty, sampled by another version too) go unscored: the trainer recomputes
        them; so do all of them when the scoring fails (counted, logged): it saves the trainer work,
        and must never cost a sample."""
        if self.scorer is None or self._params is None:
            return finished
        version = self._version
        eligible = [
            i
            for i, traj in enumerate(finished)
            if traj.response_ids and traj.prompt_ids and traj.version == version and traj.versions_seen == (version,)
        ]
        if not eligible:
            return finished
        try:
            scores = self.scorer(self._params, [(finished[i].prompt_ids, finished[i].response_ids) for i in eligible])
        except Exception as err:  # noqa: BLE001 - any failure: posted unscored, the trainer recomputes them
            log.warning(
                "worker %d: scoring %d trajectories failed (%s); the trainer recomputes them",
                self.slice_id,
                len(eligible),
                err,
            )
            self._count(score_failures=len(eligible))
            return finished
        out = list(finished)
        for i, logps in zip(eligible, scores, strict=True):
            out[i] = dataclasses.replace(
                out[i], behaviour_logprobs=tuple(logps.tolist()), behaviour_digest=self._digest
            )
        self._count(scored=len(eligible))
        return out

    def block_until_ready(self) -> None:
        """Waits until the device has run everything dispatched (the step in flight included);
        reads nothing, so the host record is unchanged."""
        jax.block_until_ready((self._state, [unread.result for unread in self._unread]))

    def _admit(self) -> None:
        """Admits queued requests, in queue order, into free slots (or one whose last token is in
        flight) while the KV pool has their pages: several at once by batched prefills when they
        are short enough (`engine.prefill_insert`), the others each by its prefill(s) and insert."""
        picked = self._pick()
        batch = [p for p in picked if self.batched_prefill and self._engine.config.batchable(len(p[2]))]
        if len(batch) < 2:
            batch = []
        if batch:
            self._admit_batch(batch)
        for slot, (request, dispatch_t), ids in picked:
            if not any(slot == s for s, *_ in batch):
                self._admit_one(slot, request, dispatch_t, ids)

    def _pick(self) -> list[tuple[int, tuple[Request, float], np.ndarray]]:
        """(slot, queued entry, ids to prefill) of the requests to admit now, taken off the queue;
        paged, each one's pages counted against the pool (as if the ones before it held theirs)."""
        picked, reserved = [], 0
        for slot, record in enumerate(self._slots):
            if not self._queue:
                break
            if record is not None and record.needs_tokens:
                continue
            # Free, or its last token is in flight: that step consumes the state before this insert.
            request, dispatch_t = self._queue[0]
            ids = np.asarray(request.prompt_ids + request.prefix_response_ids, np.int32)
            tokens = len(ids) - (0 if not request.prefix_response_ids else 1)
            if self._engine.admit_shortfall(slot, tokens, reserved=reserved):
                break  # paged: not enough free KV pages for it and the next step; it waits, first in line
            reserved += self._engine.pages_for_prefill(tokens)
            picked.append((slot, self._queue.popleft(), ids))
        return picked

    def _admit_batch(self, batch) -> None:
        """Batched prefills of `batch` [(slot, (request, dispatch_t), ids)]; a group's later sample
        takes the whole pages of its prompt from the slot that holds it (paged), as in `_admit_one`."""
        refilled = {slot for slot, *_ in batch}
        holders: dict[tuple[int, ...], int] = {}
        requests, records = [], []
        for slot, (request, dispatch_t), ids in batch:
            sample_first = not request.prefix_response_ids
            donor = None
            if sample_first and self._engine.config.paged:
                holder = self._prompt_holder(request.prompt_ids, slot, exclude=refilled)
                donor = holders.get(request.prompt_ids, None if holder is None else holder.slot)
                holders.setdefault(request.prompt_ids, slot)
            requests.append(PrefillRequest(slot, ids, request.sampling, sample_first=sample_first, shared_from=donor))
            records.append(self._admitted(slot, request, dispatch_t))
        self._state, programs = self._engine.prefill_insert(self._params, self._state, requests)
        for (slot, *_), record in zip(batch, records):
            self._slots[slot] = record
        for result, members in programs:
            rows = tuple(records[i] if requests[i].sample_first else None for i in members)
            if any(rows):
                self._unread.append(self._in_flight(result, rows, decode_step=False))
        self._count(
            prefills=len(batch),
            prefill_tokens=sum(len(ids) for *_, ids in batch),
            prefill_batches=sum(len(members) > 1 for _, members in programs),
        )

    def _admit_one(self, slot: int, request: Request, dispatch_t: float, ids: np.ndarray) -> None:
        """`request`'s prefill (in chunks when long) and insert into `slot`."""
        sample_first = not request.prefix_response_ids
        # A group's later sample shares the whole pages of its prompt with a slot that holds it.
        donor = self._prompt_holder(request.prompt_ids, slot) if sample_first else None
        shared = None if donor is None else self._engine.shared_prefix(self._state, donor.slot, len(ids))
        prefix, begin = shared, 0 if shared is None else int(shared.length)
        for chunk in self._engine.config.prefill_chunks(len(ids) - begin):  # one chunk unless a long prompt
            begin += chunk
            prefix, first = self._engine.prefill(
                params=self._params,
                existing_prefix=prefix,
                padded_tokens=ids[begin - chunk : begin],
                true_length=chunk,
                sampling=request.sampling,
                sample_first=sample_first or begin < len(ids),
            )
        shared_from = None if shared is None else donor.slot
        self._state = self._engine.insert(prefix, self._state, slot, shared_from=shared_from)
        admitted = self._admitted(slot, request, dispatch_t)
        self._slots[slot] = admitted
        reused = 0 if shared is None else int(shared.length)
        self._count(prefills=1, prefill_tokens=len(ids) - reused, shared_prompt_tokens=reused)
        if sample_first:
            self._unread.append(self._in_flight(first, (admitted,), decode_step=False))

    def _admitted(self, slot: int, request: Request, dispatch_t: float) -> _Active:
        return _Active(
            request,
            list(request.prefix_response_ids),
            list(request.prefix_logprobs),
            list(request.prefix_versions),
            dispatch_t,
            slot=slot,
            admit_t=self._clock(),
            seq=self._next_seq(),
        )

    def _dispatch(self) -> list[_Unread]:
        """One generate over every slot, when some record needs a token; its tokens unread."""
        self._make_room()
        records = tuple(record if record is not None and record.needs_tokens else None for record in self._slots)
        if not any(records):
            return []
        self._state, result = self._engine.generate(self._params, self._state)
        return [self._in_flight(result, records, decode_step=True)]

    def _prompt_holder(self, prompt_ids: tuple[int, ...], slot: int, exclude=frozenset()) -> _Active | None:
        """The newest open record in another slot than `slot` (and those in `exclude`) whose prompt
        is `prompt_ids`."""
        holders = [
            r
            for r in self._slots
            if r is not None
            and not r.closed
            and r.slot != slot
            and r.slot not in exclude
            and r.request.prompt_ids == prompt_ids
        ]
        return max(holders, key=lambda r: r.seq, default=None)

    def _make_room(self) -> None:
        """Paged: preempts the youngest decoding requests until the next step's KV pages are free.
        A preempted request goes back to the front of the queue with its tokens so far and is
        re-prefilled (same version, same per-position sampling keys: the same continuation) when
        pages free up; its tokens in flight are dropped and recomputed then."""
        while self._engine.page_shortfall():
            victims = [r for r in self._slots if r is not None and r.needs_tokens]
            victims = [r for r in victims if self._validate(self._resumption(r)) is None]
            if not victims:
                return  # generate says what is short
            victim = max(victims, key=lambda r: r.seq)
            self._close(victim)
            self._queue.appendleft((self._resumption(victim), victim.dispatch_t))
            self._count(preemptions=1)

    @staticmethod
    def _resumption(record: _Active) -> Request:
        """The Request that resumes `record` by re-prefill of its prompt and tokens read so far."""
        return dataclasses.replace(
            record.request,
            prefix_response_ids=tuple(record.response_ids),
            prefix_logprobs=tuple(record.logprobs),
            prefix_versions=tuple(record.versions),
        )

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _in_flight(self, result: ResultTokens, records: tuple[_Active | None, ...], *, decode_step: bool) -> _Unread:
        result.copy_to_host_async()
        for record in records:
            if record is not None:
                record.in_flight += 1
        return _Unread(result, records, self._version, decode_step)

    def _read(self) -> list[Trajectory]:
        """Reads every unread result, oldest first, into the records it was dispatched for."""
        done = []
        while self._unread:
            unread = self._unread.popleft()
            host = unread.result.convert_to_numpy()
            tokens, logprobs = host.data[:, 0].tolist(), host.log_prob[:, 0].tolist()
            accepted = 0
            for record, token, logprob in zip(unread.records, tokens, logprobs):
                if record is None:
                    continue
                record.in_flight -= 1
                if not record.closed:
                    accepted += 1
                    done += self._append(record, token, logprob, unread.version)
            self._count(generated_tokens=accepted)
            if unread.decode_step:
                idle = self.num_slots - accepted
                self._count(decode_steps=1, slot_steps=self.num_slots, idle_slot_steps=idle)
        return done

    def _append(self, record: _Active, token: int, logprob: float, version: int) -> list[Trajectory]:
        record.response_ids.append(token)
        record.logprobs.append(logprob)
        record.versions.append(version)
        reason = self._finish_reason(record)
        if reason is None:
            return []
        self._close(record)
        self._count(finished=1)
        return [self._trajectory(record, reason)]

    def _close(self, record: _Active) -> None:
        """Ends `record` here; its slot is freed unless a new request already took it."""
        record.closed = True
        if self._slots[record.slot] is record:
            self._slots[record.slot] = None
            self._engine.free_resource(record.slot)

    def _finish_reason(self, record: _Active) -> FinishReason | None:
        request, count, token = record.request, len(record.response_ids), record.response_ids[-1]
        if request.forced_length is not None:
            return FinishReason.FORCED if count >= request.forced_length else None
        if token in self._eos:
            return FinishReason.EOS
        if token in request.stop_ids:
            return FinishReason.STOP
        return FinishReason.LENGTH if count >= request.max_new_tokens else None

    def _trajectory(self, record: _Active, reason: FinishReason, error: str | None = None) -> Trajectory:
        request, now = record.request, self._clock()
        return Trajectory(
            traj_id=request.traj_id,
            group_id=request.group_id,
            prompt_id=request.prompt_id,
            prompt_ids=request.prompt_ids,
            response_ids=tuple(record.response_ids),
            logprobs=tuple(record.logprobs),
            version=request.version,
            versions_seen=tuple(sorted(set(record.versions))),
            finish_reason=reason,
            slice_id=self.slice_id,
            error=error,
            dispatch_t=record.dispatch_t,
            finish_t=now,
            num_migrations=record.num_migrations,
            decode_s=now - record.admit_t if record.admit_t is not None else 0.0,
        )

    # ------------------------------------------------------------------ migration
    def migration_choice(self, traj_id: str, *, to_host: bool = True) -> str:
        """How in-flight `traj_id` should leave: "kv" (its KV rows, as `export_requests`, on host
        or left on the devices) or "reprefill" (at the destination), by `self.migration`'s costs."""
        (record,) = [r for r in self._slots if r is not None and r.request.traj_id == traj_id]
        resumption = self._resumption(record)
        if self._validate(resumption) is not None:
            return migration_rule.KV  # its prefix is too long to re-prefill
        cfg, model = self._engine.config, self._engine.model_config
        position = len(record.request.prompt_ids) + len(record.response_ids) - 1
        rows = position if to_host else cfg.rows_bucket(max(position, 1))
        row_bytes = 2 * model.num_layers * model.num_kv_heads * model.head_dim * np.dtype(model.dtype).itemsize
        chunks = cfg.prefill_chunks(position + 1)  # prompt + tokens so far, the last one's input included
        buckets = [next(b for b in cfg.prefill_buckets if b >= n) for n in chunks]
        return self.migration.choose(rows * row_bytes, buckets)

    def export_requests(self, traj_ids: Iterable[str] | None = None, *, to_host: bool = True) -> list[SlotState]:
        """Removes in-flight requests (all, or `traj_ids`) from this worker, with their KV cache
        (on host, or with `to_host=False` left on the slice's devices: see `export_slot`)."""
        wanted = None if traj_ids is None else set(traj_ids)
        if wanted is not None:
            unknown = wanted - set(self.active_traj_ids)
            if unknown:
                raise ValueError(
                    f"worker {self.slice_id} has no in-flight request {sorted(unknown)} "
                    f"(queued ones leave with take_queued)"
                )
        exported = []
        for slot, record in enumerate(self._slots):
            if record is None or (wanted is not None and record.request.traj_id not in wanted):
                continue
            exported.append(
                self._engine.export_slot(
                    self._state,
                    slot,
                    request=record.request,
                    response_ids=record.response_ids,
                    logprobs=record.logprobs,
                    token_versions=record.versions,
                    version=self._version,
                    in_flight=record.in_flight,  # the step in flight: its token is recomputed there
                    to_host=to_host,
                )
            )
            self._close(record)
            self._count(exports=1)
        return exported

    def release_requests(self, traj_ids: Iterable[str]) -> list[Request]:
        """Removes in-flight requests without reading their KV rows: each as the Request that
        resumes it by re-prefill (tokens so far as its prefix; its tokens in flight are dropped
        and recomputed there)."""
        wanted = set(traj_ids)
        released = []
        for record in self._slots:
            if record is not None and record.request.traj_id in wanted:
                released.append(self._resumption(record))
                self._close(record)
                self._count(exports=1)
        return released

    def _placed(self, state: SlotState) -> SlotState:
        """`state` with KV rows that sit on other devices copied onto this slice's, timed: the
        copy's rate is a measurement of the link for the migration rule."""
        target = self._engine.get_prefix_destination_sharding()
        if not isinstance(state.k_LSKD, jax.Array) or state.k_LSKD.sharding == target.k_LRKD:
            return state
        start = time.perf_counter()
        k, v = jax.block_until_ready(jax.device_put((state.k_LSKD, state.v_LSKD), (target.k_LRKD, target.v_LRKD)))
        self.migration.observe_link(state.num_bytes, time.perf_counter() - start)
        return dataclasses.replace(state, k_LSKD=k, v_LSKD=v)

    def progress(self) -> dict[str, Request]:
        """Every request on this worker as a Request that resumes it by re-prefill (tokens so far
        as its prefix), leaving the worker untouched: what a checkpoint keeps of in-flight work."""
        out = {r.traj_id: r for r, _ in self._queue}
        for record in self._slots:
            if record is not None:
                out[record.request.traj_id] = self._resumption(record)
        return out

    def take_queued(self, traj_ids: Iterable[str] | None = None) -> list[Request]:
        """Removes queued, not yet admitted requests (all, or `traj_ids`) and returns them."""
        wanted = None if traj_ids is None else set(traj_ids)
        taken, kept = [], collections.deque()
        for request, dispatch_t in self._queue:
            (taken if wanted is None or request.traj_id in wanted else kept).append((request, dispatch_t))
        self._queue = kept
        return [request for request, _ in taken]

    def import_requests(self, states: Sequence[SlotState]) -> None:
        """Continues exported requests here with no prefill; they must match this worker's version."""
        if len(states) > self.num_free_slots:
            raise ValueError(
                f"worker {self.slice_id} has {self.num_free_slots} free slots; cannot import {len(states)}"
            )
        for state in states:
            self._check_new_id(state.request.traj_id)
            if state.kv_ticket is not None:
                raise ValueError(
                    f"slot state of {state.request.traj_id!r} still has its KV rows at {state.kv_ticket.address} "
                    "(pull them first: dora_jax.transport.kv_transfer)"
                )
            if state.version != self._version:
                raise ValueError(
                    f"slot state of {state.request.traj_id!r} is version {state.version}; worker "
                    f"{self.slice_id} serves version {self._version} (migrate only within a version)"
                )
            problem = self._validate(state.request, prefill=False)
            if problem:
                raise ValueError(f"cannot import {state.request.traj_id!r}: {problem}")
        for state in states:
            slot = self._slots.index(None)
            self._state = self._engine.import_slot(self._state, slot, self._placed(state))
            self._slots[slot] = _Active(
                state.request,
                list(state.response_ids),
                list(state.logprobs),
                list(state.token_versions),
                self._clock(),
                num_migrations=1,
                slot=slot,
                seq=self._next_seq(),
            )
            self._count(imports=1)


def export_from(worker, traj_ids: Sequence[str], *, to_host: bool = True, kv: bool = True) -> list:
    """The RolloutPort's `export` on a worker (a RolloutWorker, or a multi-host MirroredWorker):
    admitted requests leave as SlotStates with their KV rows (`to_host`: on host, else on the
    slice's devices) or, where `worker.migration_choice` finds re-prefilling them cheaper (all of
    them with `kv=False`: the caller re-prefills them, e.g. a partial rollout's interrupt), as
    Reprefills, their rows never read; queued ones as Requests; ids that already finished are
    absent."""
    wanted = set(traj_ids)
    active = [t for t in worker.active_traj_ids if t in wanted]
    queued = [t for t in worker.queued_traj_ids if t in wanted]
    reprefill = [t for t in active if not kv or worker.migration_choice(t, to_host=to_host) == migration_rule.REPREFILL]
    moving = [t for t in active if t not in reprefill]
    out = worker.export_requests(moving, to_host=to_host) if moving else []
    out += [Reprefill(r) for r in worker.release_requests(reprefill)] if reprefill else []
    return out + (worker.take_queued(queued) if queued else [])


def import_into(worker, items: Sequence) -> None:
    """The RolloutPort's `import_`: SlotStates continue with no prefill, Reprefills and Requests
    are queued."""
    states = [i for i in items if isinstance(i, SlotState)]
    if states:
        worker.import_requests(states)
    for item in items:
        if isinstance(item, Reprefill | Request):
            worker.submit(item.request if isinstance(item, Reprefill) else item)
