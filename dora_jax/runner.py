"""The embedded runner: every role in one process on the local devices.

The local devices are split into a trainer slice and R rollout slices; each rollout slice runs a
RolloutWorker on its own thread (`WorkerThread`), the coordinator runs its event loop on
another, and the trainer loop runs on the caller's thread:

    take TBS samples (version window) -> pack -> train step (behaviour log-probs per version from
    the ParamStore) -> publish v+1 to the store -> coordinator: rebalance / migrate / supplement.

Writes WORKDIR/config.json, ledger.jsonl, metrics.jsonl and TensorBoard events.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from concurrent.futures import Future
from typing import Callable, Optional


from dora_jax import sharding
from dora_jax.coordinator.audit import AuditReport, audit
from dora_jax.coordinator.coordinator import Coordinator
from dora_jax.coordinator.ledger import Ledger
from dora_jax.metrics import MetricsWriter
from dora_jax.records import Trajectory
from dora_jax.rollout.engine import EngineConfig, RolloutEngine
from dora_jax.rollout.worker import RolloutWorker
from dora_jax.run_config import RunConfig
from dora_jax.setup import Setup, build_setup
from dora_jax.store import InProcessTier, ParamStore
from dora_jax.trainer import Trainer, make_train_batch
from dora_jax.worker_thread import SliceError, WorkerThread


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


class _Scorer:
    """Adapts the task's RewardPool to the coordinator's scorer seam: (reward, error) futures."""

    def __init__(self, pool, prompts: dict, decode: Callable):
        self._pool, self._prompts, self._decode = pool, prompts, decode

    def submit(self, trajectory: Trajectory) -> Future:
        out: Future = Future()
        prompt = self._prompts.get(trajectory.prompt_id)
        try:
            text = self._decode(trajectory.response_ids)
        except Exception as err:  # undecodable response: a masked sample, not a crash
            out.set_result((0.0, f"decode error: {err}"))
            return out
        inner = self._pool.submit(trajectory.traj_id, (prompt, text))
        inner.add_done_callback(lambda f: out.set_result(_unpack(f)))
        return out


def _unpack(future: Future):
    try:
        result = future.result()
    except Exception as err:
        return 0.0, f"reward pool error: {err}"
    return float(result.value), result.error


def run(config: RunConfig, workdir: str, *, setup: Optional[Setup] = None, progress: bool = True,
        forced_length: Optional[Callable[[str, int], Optional[int]]] = None,
        scorer=None, write_config: Optional[dict] = None) -> RunResult:
    """Runs `config.num_steps` training steps; see the module docstring."""
    os.makedirs(workdir, exist_ok=True)
    if write_config is not None:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(write_config, f, indent=1, default=str)
    setup = setup or build_setup(config, workdir)
    slices = sharding.split_devices(dict(config.mesh.trainer), dict(config.mesh.rollout), config.rollout.num_slices,
                                    time_shared=config.mesh.time_shared)
    store = ParamStore(InProcessTier())
    trainer = Trainer(setup.graphdef, setup.params, setup.axes, slices.trainer, config.trainer, store)
    trainer.publish()
    engine_config = EngineConfig(num_slots=config.rollout.slots, cache_length=config.rollout.cache_length,
                                 max_prefill_length=config.rollout.max_prefill_length)
    ledger = Ledger(os.path.join(workdir, "ledger.jsonl"))
    prompts: dict = {}

    def next_prompt():
        prompt = setup.task.source.next()
        prompts[prompt.prompt_id] = prompt
        return prompt.prompt_id, prompt.prompt_ids

    pool = None
    if scorer is None:
        pool = setup.task.make_reward_pool(setup.reward_workers, setup.reward_timeout_s)
        scorer = _Scorer(pool, prompts, setup.tokenizer.decode)
    holder: list[Coordinator] = []
    threads = []
    for slice_id, mesh in enumerate(slices.rollout):
        engine = RolloutEngine(setup.model_config, engine_config, mesh, tokenizer=setup.tokenizer)
        worker = RolloutWorker(engine, slice_id=slice_id, eos_ids=setup.eos_ids)
        shardings = engine.param_shardings  # the slice's own layout (ROLLOUT_RULES)
        engine.warmup(store.get(0, shardings))
        threads.append(WorkerThread(worker, lambda v, sh=shardings: store.get(v, sh),
                                    lambda sid, trajs: holder[0].post_finished(sid, trajs)))
    coord = Coordinator(config.coordinator, {t.slice_id: t for t in threads}, next_prompt, scorer, ledger,
                        forced_length=forced_length)
    holder.append(coord)
    metrics_writer = MetricsWriter(workdir, tensorboard=config.tensorboard)
    stop = threading.Event()
    loop_error: list[BaseException] = []

    def coordinator_loop():
        try:
            while not stop.is_set():
                coord.process(timeout=0.005)
                failed = [t for t in threads if t.error is not None]
                if failed:
                    raise SliceError(failed[0].slice_id, failed[0].error)
        except BaseException as err:
            loop_error.append(err)
            coord.closed = True

    start = time.perf_counter()
    coord.start()
    loop = threading.Thread(target=coordinator_loop, name="coordinator", daemon=True)
    loop.start()
    rows, train_busy, train_timeline = [], 0.0, []
    bar = _progress(config.num_steps, progress)
    try:
        last = _slot_totals(threads)
        for step in range(config.num_steps):
            groups = coord.take_batch(trainer.version)
            if groups is None:
                raise loop_error[0] if loop_error else RuntimeError("coordinator closed")
            t0 = time.perf_counter()
            batch = make_train_batch(groups, config.pad_to, setup.tokenizer.pad_id)
            metrics = trainer.train_step(batch)
            trainer.publish()
            t1 = time.perf_counter()
            train_busy += t1 - t0
            train_timeline.append((t0, t1, metrics.version - 1))
            coord.post_published(trainer.version)
            _retire(store, coord, trainer.version)
            totals = _slot_totals(threads)
            row = _step_row(step, batch, metrics, coord, totals, last, start)
            last = totals
            rows.append(row)
            metrics_writer.write(step, row, {"staleness": [k for k, v in metrics.staleness.items() for _ in range(v)]})
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", versions=row["versions_in_flight"])
    finally:
        stop.set()
        loop.join(timeout=10)
        coord.closed = True
        for t in threads:
            t.stop()
        bar.close()
        metrics_writer.close()
        ledger.close()
        if pool is not None:
            pool.close()
    wall = time.perf_counter() - start
    report = audit(ledger.memory)
    timelines = {"start": start, "slices": [t.timeline for t in threads], "trainer": train_timeline,
                 "slot_totals": _slot_totals(threads)[:2]}
    return RunResult(workdir, wall, len(rows), rows, report, dataclasses.asdict(coord.stats),
                     [t.busy_s for t in threads], train_busy, timelines)


def _retire(store: ParamStore, coord: Coordinator, latest: int) -> None:
    """Frees versions nothing can need any more: no slice serves them, nothing unconsumed has them."""
    store.retire_below(min(coord.versions_needed() | {latest}))


def _slot_totals(threads) -> tuple[int, int, int]:
    counters = [t.worker.counters for t in threads]
    return (sum(c.slot_steps for c in counters), sum(c.idle_slot_steps for c in counters),
            sum(c.generated_tokens for c in counters))


def _step_row(step, batch, metrics, coord: Coordinator, totals, last, start) -> dict:
    slot_steps, idle, generated = (a - b for a, b in zip(totals, last))
    valid = batch.valid_B > 0
    row = {
        "reward_mean": float(batch.rewards_B[valid].mean()) if valid.any() else float("nan"),
        "valid_fraction": float(valid.mean()),
        "staleness_max": int(max(metrics.staleness)),
        "versions_in_flight": len(coord.versions_in_flight()),
        "trainer_wait_s": coord.stats.trainer_wait_s,
        "bubble_ratio": idle / slot_steps if slot_steps else 0.0,
        "generated_tokens": generated,
        "wall_s": time.perf_counter() - start,
        "response_len_mean": float(batch.loss_mask_BT.sum(1).mean()),
        "migrations_kv": coord.stats.migrations_kv,
    }
    row.update({k: v for k, v in metrics.as_dict().items() if not k.startswith("staleness/")})
    row["train_tokens_per_s"] = row.pop("tokens_per_s")
    row["tokens_per_s"] = float(batch.loss_mask_BT.sum()) / max(row["wall_s"] / (step + 1), 1e-9)
    return row


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, desc="train", unit="step")
