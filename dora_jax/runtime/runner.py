"""The embedded runner: every role in one process on the local devices.

The local devices are split into a trainer slice and R rollout slices; each rollout slice runs a
RolloutWorker on its own thread (`WorkerThread`), the coordinator runs its event loop on
another, and the trainer loop runs on the caller's thread:

    take TBS samples (version window) -> pack -> train step (behaviour log-probs per version from
    the ParamStore) -> publish v+1 to the store -> coordinator: rebalance / migrate / supplement.

With `eval.every_steps`, the newest version is evaluated on held-out prompts at version 0, every
that many steps and at the last step, through the same slices (dora_jax.runtime.evaluator): rows
in metrics.jsonl and WORKDIR/eval_samples.jsonl; the run waits for the last round before it ends.

Writes WORKDIR/config.json, ledger.jsonl, metrics.jsonl, TensorBoard events and, every
`checkpoint.every_steps` steps and on preemption, WORKDIR/checkpoints (dora_jax.runtime.checkpoint).
WORKDIR may be local or `gs://bucket/path` (every file through dora_jax.core.fs; a missing bucket
or missing credentials fail before anything starts).
A workdir that already has a ledger is resumed: from its newest checkpoint that restores, or
from scratch when the lost run never saved one; either way the ledger's `resume` event voids
what the lost process wrote after that checkpoint, so the audit over the whole ledger holds.

A rollout slice whose worker raises or stops beating is reported to the coordinator, which
re-dispatches its requests under their own version; a slice that raised is restarted (up to
`rollout.max_rejoins` times) and rejoins. A trainer failure ends the run; the last checkpoint
stays intact.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable

from dora_jax.coordinator.audit import AuditReport, audit
from dora_jax.coordinator.coordinator import Coordinator
from dora_jax.coordinator.lease import WriterLease
from dora_jax.coordinator.ledger import Ledger, read_ledger, repair_torn_tail
from dora_jax.core import fs
from dora_jax.parallel import sharding
from dora_jax.rollout.worker import RolloutWorker
from dora_jax.runtime import faults, resume, training_loop
from dora_jax.runtime.build import Setup, build_setup
from dora_jax.runtime.checkpoint import CheckpointError, RunCheckpointer, directory_of
from dora_jax.runtime.evaluator import Evaluator
from dora_jax.runtime.roles import coordinator as coordinator_role
from dora_jax.runtime.roles import rollout as rollout_role
from dora_jax.runtime.roles import trainer as trainer_role
from dora_jax.runtime.run_config import RunConfig
from dora_jax.runtime.supervisor import SliceSupervisor
from dora_jax.store import InProcessTier, ParamStore, StoreError
from dora_jax.tasks.reward_scorer import RewardPoolScorer
from dora_jax.trainer import Trainer
from dora_jax.transport.in_process import WorkerThread

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RunResult:
    workdir: str
    wall_s: float
    steps: int
    metrics: list[dict]
    audit: AuditReport
    coordinator_stats: dict
    slice_busy_s: list[float]
    train_busy_s: float
    timelines: dict
    resumed_from: int | None = None  # checkpoint step this process started from (0: from scratch)
    preempted: bool = False  # stopped early on request (SIGTERM), after a checkpoint
    checkpoint_errors: list = dataclasses.field(default_factory=list)
    checkpoint_s: list = dataclasses.field(default_factory=list)  # seconds the trainer spent per save
    evals: list = dataclasses.field(default_factory=list)  # one metrics row per evaluation round (Evaluator)
    reward_curve: str | None = None  # WORKDIR/reward_curve.png: training reward and evaluation curves


def run(
    config: RunConfig,
    workdir: str,
    *,
    setup: Setup | None = None,
    progress: bool = True,
    forced_length: Callable[[str, int], int | None] | None = None,
    scorer=None,
    write_config: dict | None = None,
    preempt: threading.Event | None = None,
) -> RunResult:
    """Runs (or resumes) to `config.num_steps` training steps; see the module docstring. Setting
    `preempt` stops the run at the next step boundary with a checkpoint. Holds the workdir's
    writer lease throughout (dora_jax.coordinator.lease): a workdir another live coordinator runs
    is refused (`LeaseHeld`), before anything is read or written."""
    fs.makedirs(workdir)  # gs://: fails here, naming the path, without credentials or bucket
    with WriterLease.acquire(workdir):
        return _run(config, workdir, setup, progress, forced_length, scorer, write_config, preempt)


def _run(
    config: RunConfig,
    workdir: str,
    setup: Setup | None,
    progress: bool,
    forced_length: Callable[[str, int], int | None] | None,
    scorer,
    write_config: dict | None,
    preempt: threading.Event | None,
) -> RunResult:
    ledger_path = fs.join(workdir, "ledger.jsonl")
    resuming = fs.exists(ledger_path) and fs.size(ledger_path) > 0
    if write_config is not None and not resuming:
        with fs.open(fs.join(workdir, "config.json"), "w") as f:
            json.dump(write_config, f, indent=1, default=str)
    placement = _Embedded(config, workdir, setup, resuming, preempt)
    placement.build(scorer, forced_length, write_config)
    return placement.run(progress)


class _Embedded:
    """The embedded placement of one run: the roles of dora_jax.runtime.roles on the local devices,
    wired with in-process ports. `build` makes every role (restoring the trainer and the
    coordinator from the newest checkpoint when resuming); `run` trains to the end and reports."""

    def __init__(self, config: RunConfig, workdir: str, setup: Setup | None, resuming: bool, preempt):
        self.config, self.workdir, self.resuming, self.preempt = config, workdir, resuming, preempt
        self.ledger_path = fs.join(workdir, "ledger.jsonl")
        self.devices = sharding.split_devices(
            dict(config.mesh.trainer),
            dict(config.mesh.rollout),
            config.rollout.num_slices,
            time_shared=config.mesh.time_shared,
        )
        self.setup = setup or build_setup(config, workdir, mesh=self.devices.trainer)
        self.fingerprint = resume.fingerprint(config, self.setup)
        self.store = ParamStore(InProcessTier())
        s = self.setup
        self.trainer = Trainer(s.graphdef, s.params, s.axes, self.devices.trainer, config.trainer, self.store)
        self.checkpointer = RunCheckpointer(directory_of(workdir), keep=config.checkpoint_keep)
        self.restored = None
        if resuming:
            repair_torn_tail(self.ledger_path)
            self.restored = trainer_role.restore(self.checkpointer, self.trainer, self.store, self.fingerprint)
        self.trainer.publish()
        trainer_role.warmup(config, self.trainer)
        self.checkpoint_errors: list[str] = []
        self.checkpoint_s: list[float] = []
        self.loop_error: list[BaseException] = []
        self.stop = threading.Event()
        self.pool = None

    # ------------------------------------------------------------------ build
    def build(self, scorer, forced_length, write_config: dict | None) -> None:
        config, setup = self.config, self.setup
        self.ledger = Ledger(self.ledger_path)
        held_out = coordinator_role.held_out_prompts(config, setup.task, setup.tokenizer)
        self.drawer = coordinator_role.PromptDrawer(setup.task, held_out)
        if scorer is None:
            self.pool = setup.task.make_reward_pool(setup.reward_workers, setup.reward_timeout_s)
            scorer = RewardPoolScorer(self.pool, self.drawer.book, setup.tokenizer.decode)
        self.load_faults: set[int] = set()  # slices whose next version fetch fails (DORA_FAULTS slice_load_error)
        self.score_faults: set[int] = set()  # slices whose scoring fails from now on (DORA_FAULTS score_error)
        self.slices = [self._build_slice(slice_id, mesh) for slice_id, mesh in enumerate(self.devices.rollout)]
        self.threads = {s.slice_id: self._start_slice(s.slice_id) for s in self.slices}
        self.coord = coordinator_role.build(
            config,
            self.threads,
            self.drawer,
            scorer,
            self.ledger,
            vocab_size=setup.model_config.vocab_size,
            initial_version=self.trainer.version,
            forced_length=forced_length,
            on_slice_dropped=self._slice_dropped,
        )
        self.supervisor = SliceSupervisor(
            self.coord,
            self.threads,
            self._start_slice,
            heartbeat_timeout_s=config.rollout.heartbeat_timeout_s,
            max_rejoins=config.rollout.max_rejoins,
        )
        if self.resuming:
            coordinator_role.restore(self.coord, self.drawer, trainer_role.coordinator_state(self.restored))
        self.start_step = self.trainer.version
        trainer_role.trim_rows(self.workdir, self.start_step)
        self.writer = trainer_role.open_writer(config, self.workdir, write_config)
        self.evaluator = Evaluator(
            config.eval,
            config.num_steps,
            held_out,
            self.drawer.leaks,
            self.coord,
            setup.tokenizer.decode,
            self.workdir,
            self.writer,
        )

    def _build_slice(self, slice_id: int, mesh) -> _Slice:
        setup = self.setup
        engine = rollout_role.build_engine(self.config, setup.model_config, mesh, setup.tokenizer)
        params = self.store.get(self.trainer.version, engine.param_shardings)
        part = _Slice(self.config, engine, slice_id, setup.eos_ids, self.store, (self.load_faults, self.score_faults))
        rollout_role.warmup(self.config, engine, part.plain_scorer, params)
        return part

    def _start_slice(self, slice_id: int) -> WorkerThread:
        """Slice `slice_id`'s worker on a thread (at start, and again when the supervisor restarts it)."""
        part = self.slices[slice_id]
        return WorkerThread(
            part.worker(),
            part.fetch,
            self._post_finished,
            command_timeout_s=self.config.rollout.heartbeat_timeout_s,
        )

    def _post_finished(self, slice_id: int, trajectories) -> None:
        self.coord.post_finished(slice_id, trajectories)

    def _slice_dropped(self, slice_id: int, why: str) -> bool:
        return self.supervisor.dropped(slice_id, why)

    # ------------------------------------------------------------------ run
    def run(self, progress: bool) -> RunResult:
        config = self.config
        self.bar = _progress(config.num_steps - self.start_step, progress)
        self.start = time.perf_counter()
        self.coord.start()
        self.evaluator.maybe_request(self.trainer.version)
        self.loop = threading.Thread(target=self._serve_coordinator, name="coordinator", daemon=True)
        self.loop.start()
        source = CoordinatorSource(
            self.coord, self.store, self.supervisor.all_threads, cancel=self.preempt, loop_error=self._loop_error
        )
        try:
            loop_result = training_loop.train(
                self.trainer,
                source,
                **training_loop.sizes(config, self.setup.tokenizer.pad_id),
                writer=self.writer,
                after_step=trainer_role.AfterStep(self.evaluator, self._checkpoint_due, self._inject_faults),
                on_row=self._on_row,
                should_stop=self._preempting,
                start=self.start,
            )
            preempted = self.trainer.version < config.num_steps
            rows = loop_result.rows
            if preempted and not (rows and "checkpoint_s" in rows[-1]):
                self._save_checkpoint()  # preempted while waiting for a batch: nothing taken since the last step
            if not preempted:
                trainer_role.finish_evaluation(self.evaluator, config.eval.final_timeout_s)
        finally:
            curve = self._close()
        return self._result(loop_result, preempted, curve)

    def _serve_coordinator(self) -> None:
        """The coordinator's loop thread; an error ends the run (the trainer's next take raises it)."""
        try:
            coordinator_role.serve(self.coord, self._serving, self.supervisor.check)
        except BaseException as err:
            self.loop_error.append(err)
            self.coord.closed = True

    def _serving(self) -> bool:
        return not self.stop.is_set()

    def _loop_error(self) -> BaseException | None:
        return self.loop_error[0] if self.loop_error else None

    def _preempting(self) -> bool:
        return self.preempt is not None and self.preempt.is_set()

    def _on_row(self, row: dict) -> None:
        self.bar.update(1)
        self.bar.set_postfix(reward=f"{row['reward_mean']:.3f}", versions=row["versions_in_flight"])

    def _inject_faults(self, step: int) -> None:
        """The slice faults DORA_FAULTS arms after `step` (dora_jax.runtime.faults)."""
        for sid, kind in faults.slices_to_fail(step):
            if kind == "load_error":
                self.load_faults.add(sid)
            elif kind == "score_error":
                self.score_faults.add(sid)
            else:
                self.threads[sid].inject_failure(
                    "hang" if kind == "hang" else RuntimeError(f"injected failure after step {step}")
                )

    def _checkpoint_due(self, step: int) -> dict:
        every = self.config.checkpoint_every
        if (every and (step + 1) % every == 0) or self._preempting():
            self._save_checkpoint()
            return {"checkpoint_s": self.checkpoint_s[-1]}
        return {}

    def _save_checkpoint(self) -> None:
        t0 = time.perf_counter()
        try:
            state = self._coordinator_snapshot()
            meta = trainer_role.checkpoint_meta(state, self.trainer.version, self.fingerprint)
            trainer_role.save(self.checkpointer, self.trainer, self.store, meta)
        except (CheckpointError, OSError) as err:  # e.g. disk full: keep running on the previous one
            log.warning("%s; the previous checkpoint stays in use", err)
            self.checkpoint_errors.append(str(err))
        self.checkpoint_s.append(time.perf_counter() - t0)

    def _coordinator_snapshot(self) -> dict:
        """The coordinator's state at the trainer's version. The loop thread takes the snapshot (it
        calls the ports) and the live prompts with it, under its lock (the prompt book forgets what
        is no longer live there); the trainer thread waits."""
        self.coord.wait_for_version(self.trainer.version)
        future = self.coord.request_snapshot(extra=self.drawer.snapshot_extra)
        while not future.done():
            if not self.loop.is_alive():
                raise CheckpointError("the coordinator's loop has stopped: no snapshot for this checkpoint")
            concurrent.futures.wait([future], timeout=0.1)
        return future.result()

    # ------------------------------------------------------------------ the end
    def _close(self) -> str | None:
        """Stops every role and closes what the run writes; returns the reward PNG's path."""
        try:
            self.checkpointer.close()
        except Exception as err:
            self.checkpoint_errors.append(f"checkpoint in {self.checkpointer.directory} failed: {err}")
        self.stop.set()
        self.loop.join(timeout=10)
        self.coord.closed = True
        for t in self.supervisor.all_threads:
            t.stop()
        self.bar.close()
        curve = trainer_role.close_writer(self.writer, self.workdir)
        self.ledger.close()
        if self.pool is not None:
            self.pool.close()
        return curve

    def _result(self, loop_result, preempted: bool, curve: str | None) -> RunResult:
        wall = time.perf_counter() - self.start
        threads = self.supervisor.all_threads
        timelines = {
            "start": self.start,
            "slices": [t.timeline for t in threads],
            "trainer": loop_result.timeline,
            "slot_totals": _slot_totals(threads)[:2],
        }
        stats = dataclasses.asdict(self.coord.stats)
        stats["slice_drops"] = [f"slice {sid}: {why}" for sid, why in self.supervisor.drops]
        stats["slice_restarts"] = dict(self.supervisor.rejoins)
        resumed_from = (self.restored.step if self.restored else 0) if self.resuming else None
        return RunResult(
            self.workdir,
            wall,
            len(loop_result.rows),
            loop_result.rows,
            audit(read_ledger(self.ledger_path)),
            stats,
            [t.busy_s for t in threads],
            loop_result.train_busy_s,
            timelines,
            resumed_from=resumed_from,
            preempted=preempted,
            checkpoint_errors=self.checkpoint_errors,
            checkpoint_s=self.checkpoint_s,
            evals=self.evaluator.results,
            reward_curve=curve,
        )


class _Slice:
    """One rollout slice of the embedded run: its warm engine, a fresh worker on it per (re)start,
    and its read of a version from the store (which fails once where DORA_FAULTS armed a load error).
    `faults`: the runner's sets of slices with an armed load error and an armed scoring error."""

    def __init__(self, config: RunConfig, engine, slice_id: int, eos_ids, store: ParamStore, faults: tuple[set, set]):
        self.config, self.engine, self.slice_id, self.eos_ids = config, engine, slice_id, eos_ids
        self._store, (self._load_faults, self._score_faults) = store, faults
        self._shardings = engine.param_shardings  # the slice's own layout (ROLLOUT_RULES)
        # One scorer per slice, shared by its workers: a restarted slice's scoring stays compiled.
        self.plain_scorer = rollout_role.make_scorer(config.trainer, engine)
        self._scorer = self.plain_scorer and _FaultyScorer(self.plain_scorer, slice_id, self._score_faults)

    def worker(self) -> RolloutWorker:
        return rollout_role.make_worker(self.config, self.engine, self.slice_id, self.eos_ids, self._scorer)

    def fetch(self, version: int):
        if self.slice_id in self._load_faults:
            self._load_faults.discard(self.slice_id)
            raise StoreError(f"version {version} could not be read for slice {self.slice_id} (injected by DORA_FAULTS)")
        return self._store.get(version, self._shardings)


class _FaultyScorer:
    """A slice's scorer that fails once DORA_FAULTS armed a scoring error for the slice."""

    def __init__(self, scorer, slice_id: int, armed: set[int]):
        self._scorer, self._slice_id, self._armed = scorer, slice_id, armed

    def __call__(self, params, sequences):
        if self._slice_id in self._armed:
            raise RuntimeError(f"slice {self._slice_id}: scoring failed (injected by DORA_FAULTS)")
        return self._scorer(params, sequences)


class CoordinatorSource:
    """The in-process `training_loop.BatchSource`: takes from the coordinator, posts publishes to
    it, retires the versions nothing needs, and reads the rollout counters off the worker threads."""

    def __init__(self, coord: Coordinator, store: ParamStore, threads: list, *, cancel, loop_error):
        self._coord, self._store, self._threads = coord, store, threads  # threads grows as slices restart
        self._cancel, self._loop_error = cancel, loop_error

    def take(self, trainer_version: int, ahead=None, committed: bool = False) -> training_loop.TakenBatch | None:
        idle = None if ahead is None else _Peeker(self._coord, trainer_version, ahead, committed)
        groups = self._coord.take_batch(trainer_version, cancel=self._cancel, idle=idle)
        if groups is None:
            if self._cancel is not None and self._cancel.is_set():
                return None
            raise self._loop_error() or RuntimeError("coordinator closed")
        return training_loop.TakenBatch(groups, self.counters())

    def published(self, version: int, behaviour_digests) -> None:
        self._coord.record_behaviour(version - 1, behaviour_digests)
        self._coord.post_published(version)
        _retire(self._store, self._coord, version)

    def counters(self) -> dict:
        slot_steps, idle, generated, preemptions = _slot_totals(self._threads)
        return {
            "slot_steps": slot_steps,
            "idle_slot_steps": idle,
            "generated_tokens": generated,
            "kv_preemptions": preemptions,
            "trainer_wait_s": self._coord.stats.trainer_wait_s,
            "trainer_wait_c3_s": self._coord.stats.trainer_wait_c3_s,
            "versions_in_flight": len(self._coord.versions_in_flight()),
            "migrations_kv": self._coord.stats.migrations_kv,
            "migrations_reprefill": self._coord.stats.migrations_reprefill,
            **{k: getattr(self._coord.stats, k) for k in training_loop.DYNAMIC_SAMPLING_COUNTERS},
        }


class _Peeker:
    """`take_batch`'s idle work: hands `ahead` finished samples the trainer will train on, each
    once (Coordinator.peek_batch; `committed`: only whole groups committed to the batch)."""

    def __init__(self, coord: Coordinator, trainer_version: int, ahead, committed: bool):
        self._coord, self._version, self._ahead, self._committed = coord, trainer_version, ahead, committed

    def __call__(self) -> bool:
        groups = self._coord.peek_batch(self._version, committed=self._committed)
        if groups:
            self._ahead(groups)
        return bool(groups)


def _retire(store: ParamStore, coord: Coordinator, latest: int) -> None:
    """Frees versions nothing can need any more: no slice serves them, nothing unconsumed has them."""
    store.retire_below(min(coord.versions_needed() | {latest}))


def _slot_totals(threads) -> tuple[int, int, int, int]:
    counters = [t.worker.counters for t in threads]
    return (
        sum(c.slot_steps for c in counters),
        sum(c.idle_slot_steps for c in counters),
        sum(c.generated_tokens for c in counters),
        sum(c.preemptions for c in counters),
    )


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, desc="train", unit="step")
