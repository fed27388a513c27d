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
from dora_jax.rollout.engine import RolloutEngine
from dora_jax.rollout.worker import RolloutWorker
from dora_jax.runtime import faults, resume, training_loop
from dora_jax.runtime.build import Setup, build_setup
from dora_jax.runtime.checkpoint import CheckpointError, RunCheckpointer, abstract_like, directory_of
from dora_jax.runtime.evaluator import Evaluator
from dora_jax.runtime.metrics import MetricsWriter, WandbSpec, draw_reward_curve
from dora_jax.runtime.run_config import RunConfig, task_config
from dora_jax.runtime.supervisor import SliceSupervisor
from dora_jax.store import InProcessTier, ParamStore, StoreError
from dora_jax.tasks.eval_set import LeakCounter, eval_prompts
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
    slices = sharding.split_devices(
        dict(config.mesh.trainer),
        dict(config.mesh.rollout),
        config.rollout.num_slices,
        time_shared=config.mesh.time_shared,
    )
    setup = setup or build_setup(config, workdir, mesh=slices.trainer)
    store = ParamStore(InProcessTier())
    trainer = Trainer(setup.graphdef, setup.params, setup.axes, slices.trainer, config.trainer, store)
    checkpointer = RunCheckpointer(directory_of(workdir), keep=config.checkpoint_keep)
    prompts = resume.PromptBook()
    restored = None
    if resuming:
        repair_torn_tail(ledger_path)
        restored = checkpointer.restore_latest(
            lambda: abstract_like(trainer.state, trainer.state_shardings),
            lambda: abstract_like(trainer.params, trainer.param_shardings),
        )
        if restored is not None:
            resume.check_resumable(restored.meta["fingerprint"], resume.fingerprint(config, setup))
            trainer.load_state(restored.trainer_state, restored.meta["trainer_version"])
            for version in sorted(restored.versions):
                store.publish(version, restored.versions[version])
            setup.task.source.restore(restored.meta["coordinator"]["extra"]["source"])
            prompts.update(resume.prompts_from_json(restored.meta["prompts"]))
    trainer.publish()
    trainer.warmup(config.rollout.cache_length, config.coordinator.train_batch_size, config.pad_to)
    engine_config = config.rollout.engine_config()
    ledger = Ledger(ledger_path)
    held_out = []
    if config.eval.enabled:
        held_out = eval_prompts(
            task_config(config), setup.task, setup.tokenizer, config.eval.num_prompts, config.eval.path
        )
        prompts.keep(held_out)
    leaks = LeakCounter(held_out)  # training prompts that are also evaluation prompts

    def next_prompt():
        prompt = setup.task.source.next()
        prompts.add(prompt)
        leaks.check(prompt)
        return prompt.prompt_id, prompt.prompt_ids

    pool = None
    if scorer is None:
        pool = setup.task.make_reward_pool(setup.reward_workers, setup.reward_timeout_s)
        scorer = RewardPoolScorer(pool, prompts, setup.tokenizer.decode)
    holder: list[Coordinator] = []
    slice_parts = []  # (worker factory, fetch) per slice, to restart a failed one
    threads: dict[int, WorkerThread] = {}
    load_faults: set[int] = set()  # slices whose next version fetch fails (DORA_FAULTS slice_load_error)
    for slice_id, mesh in enumerate(slices.rollout):
        engine = RolloutEngine(setup.model_config, engine_config, mesh, tokenizer=setup.tokenizer)
        shardings = engine.param_shardings  # the slice's own layout (ROLLOUT_RULES)
        engine.warmup(store.get(trainer.version, shardings))
        slice_parts.append(
            (
                lambda e=engine, sid=slice_id: RolloutWorker(
                    e, slice_id=sid, eos_ids=setup.eos_ids, migration=config.rollout.migration_costs()
                ),
                lambda v, sh=shardings, sid=slice_id: _fetch(store, v, sh, sid, load_faults),
            )
        )
        threads[slice_id] = _start_slice(slice_parts[slice_id], holder, config)
    supervisor_ref: list[SliceSupervisor] = []
    coord = Coordinator(
        dataclasses.replace(config.coordinator, vocab_size=setup.model_config.vocab_size),
        dict(threads),
        next_prompt,
        scorer,
        ledger,
        forced_length=forced_length,
        initial_version=trainer.version,
        on_slice_dropped=lambda sid, why: supervisor_ref[0].dropped(sid, why),
    )
    holder.append(coord)
    prompts.follow(coord)
    supervisor = SliceSupervisor(
        coord,
        threads,
        lambda sid: _start_slice(slice_parts[sid], holder, config),
        heartbeat_timeout_s=config.rollout.heartbeat_timeout_s,
        max_rejoins=config.rollout.max_rejoins,
    )
    supervisor_ref.append(supervisor)
    if resuming:
        coord.restore(restored.meta["coordinator"] if restored else None)
    start_step = trainer.version
    resume.trim_rows(fs.join(workdir, "metrics.jsonl"), start_step)
    resume.trim_rows(fs.join(workdir, "eval_samples.jsonl"), start_step)
    metrics_writer = MetricsWriter(
        workdir, tensorboard=config.tensorboard, wandb=WandbSpec.of(config.log), config=write_config
    )
    evaluator = Evaluator(
        config.eval, config.num_steps, held_out, leaks, coord, setup.tokenizer.decode, workdir, metrics_writer
    )
    stop = threading.Event()
    loop_error: list[BaseException] = []
    all_threads = supervisor.all_threads  # grows as slices restart

    def coordinator_loop():
        try:
            while not stop.is_set():
                if coord.process(timeout=0.005):
                    faults.reached("rollout")
                supervisor.check()
        except BaseException as err:
            loop_error.append(err)
            coord.closed = True

    start = time.perf_counter()
    coord.start()
    evaluator.maybe_request(trainer.version)
    loop = threading.Thread(target=coordinator_loop, name="coordinator", daemon=True)
    loop.start()
    checkpoint_errors, checkpoint_s = [], []
    bar = _progress(config.num_steps - start_step, progress)
    preempting = lambda: preempt is not None and preempt.is_set()

    def save_checkpoint() -> None:
        t0 = time.perf_counter()
        try:
            _save_checkpoint(
                checkpointer, trainer, store, coord, setup, prompts, resume.fingerprint(config, setup), loop.is_alive
            )
        except (CheckpointError, OSError) as err:  # e.g. disk full: keep running on the previous one
            log.warning("%s; the previous checkpoint stays in use", err)
            checkpoint_errors.append(str(err))
        checkpoint_s.append(time.perf_counter() - t0)

    def after_step(step: int) -> dict:
        evaluator.maybe_request(step + 1)
        evaluator.harvest()
        for sid, kind in faults.slices_to_fail(step):
            if kind == "load_error":
                load_faults.add(sid)
            else:
                threads[sid].inject_failure(
                    "hang" if kind == "hang" else RuntimeError(f"injected failure after step {step}")
                )
        if (config.checkpoint_every and (step + 1) % config.checkpoint_every == 0) or preempting():
            save_checkpoint()
            return {"checkpoint_s": checkpoint_s[-1]}
        return {}

    def on_row(row: dict) -> None:
        bar.update(1)
        bar.set_postfix(reward=f"{row['reward_mean']:.3f}", versions=row["versions_in_flight"])

    source = CoordinatorSource(
        coord, store, all_threads, cancel=preempt, loop_error=lambda: loop_error[0] if loop_error else None
    )
    try:
        loop_result = training_loop.train(
            trainer,
            source,
            **training_loop.sizes(config, setup.tokenizer.pad_id),
            writer=metrics_writer,
            after_step=after_step,
            on_row=on_row,
            should_stop=preempting,
            start=start,
        )
        rows = loop_result.rows
        preempted = trainer.version < config.num_steps
        if preempted and not (rows and "checkpoint_s" in rows[-1]):
            save_checkpoint()  # preempted while waiting for a batch: nothing taken since the last step
        if not preempted:
            evaluator.harvest(timeout=config.eval.final_timeout_s)  # the last version's round
            if evaluator.pending:
                log.warning("%d evaluation rounds did not finish; their rows are missing", evaluator.pending)
    finally:
        try:
            checkpointer.close()
        except Exception as err:
            checkpoint_errors.append(f"checkpoint in {checkpointer.directory} failed: {err}")
        stop.set()
        loop.join(timeout=10)
        coord.closed = True
        for t in all_threads:
            t.stop()
        bar.close()
        curve = draw_reward_curve(workdir)
        metrics_writer.close(images={"reward_curve": curve} if curve else None)
        ledger.close()
        if pool is not None:
            pool.close()
    wall = time.perf_counter() - start
    report = audit(read_ledger(ledger_path))
    timelines = {
        "start": start,
        "slices": [t.timeline for t in all_threads],
        "trainer": loop_result.timeline,
        "slot_totals": _slot_totals(all_threads)[:2],
    }
    stats = dataclasses.asdict(coord.stats)
    stats["slice_drops"] = [f"slice {sid}: {why}" for sid, why in supervisor.drops]
    stats["slice_restarts"] = dict(supervisor.rejoins)
    return RunResult(
        workdir,
        wall,
        len(rows),
        rows,
        report,
        stats,
        [t.busy_s for t in all_threads],
        loop_result.train_busy_s,
        timelines,
        resumed_from=(restored.step if restored else 0) if resuming else None,
        preempted=preempted,
        checkpoint_errors=checkpoint_errors,
        checkpoint_s=checkpoint_s,
        evals=evaluator.results,
        reward_curve=curve,
    )


class CoordinatorSource:
    """The in-process `training_loop.BatchSource`: takes from the coordinator, posts publishes to
    it, retires the versions nothing needs, and reads the rollout counters off the worker threads."""

    def __init__(self, coord: Coordinator, store: ParamStore, threads: list, *, cancel, loop_error):
        self._coord, self._store, self._threads = coord, store, threads  # threads grows as slices restart
        self._cancel, self._loop_error = cancel, loop_error

    def take(self, trainer_version: int) -> training_loop.TakenBatch | None:
        groups = self._coord.take_batch(trainer_version, cancel=self._cancel)
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
            "versions_in_flight": len(self._coord.versions_in_flight()),
            "migrations_kv": self._coord.stats.migrations_kv,
            "migrations_reprefill": self._coord.stats.migrations_reprefill,
            **{k: getattr(self._coord.stats, k) for k in training_loop.DYNAMIC_SAMPLING_COUNTERS},
        }


def _fetch(store: ParamStore, version: int, shardings, slice_id: int, load_faults: set[int]):
    """A slice's read of a version; fails once where DORA_FAULTS armed a load error."""
    if slice_id in load_faults:
        load_faults.discard(slice_id)
        raise StoreError(f"version {version} could not be read for slice {slice_id} (injected by DORA_FAULTS)")
    return store.get(version, shardings)


def _start_slice(parts, holder, config: RunConfig) -> WorkerThread:
    make_worker, fetch = parts
    return WorkerThread(
        make_worker(),
        fetch,
        lambda sid, trajs: holder[0].post_finished(sid, trajs),
        command_timeout_s=config.rollout.heartbeat_timeout_s,
    )


# --------------------------------------------------------------------------- checkpoints
def _save_checkpoint(checkpointer, trainer, store, coord, setup, prompts, fp, loop_alive) -> None:
    coord.wait_for_version(trainer.version)
    # The loop thread takes the snapshot (it calls the ports) and the live prompts with it, under
    # its lock (the prompt book forgets what is no longer live there); the trainer thread waits.
    future = coord.request_snapshot(extra=lambda: prompts.snapshot_extra(setup.task.source))
    while not future.done():
        if not loop_alive():
            raise CheckpointError("the coordinator's loop has stopped: no snapshot for this checkpoint")
        concurrent.futures.wait([future], timeout=0.1)
    state = future.result()
    meta = resume.meta(state, trainer.version, state["extra"].pop("prompts"), fp)
    versions = {v: store.get(v, trainer.param_shardings, copy=False) for v in meta["versions"]}
    faults.before_checkpoint_save()
    checkpointer.save(trainer.version, trainer.state, versions, meta)
    faults.reached("checkpoint_save")


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
