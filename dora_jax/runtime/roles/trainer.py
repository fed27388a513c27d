"""The trainer role, for every placement: its checkpoints (restore, the meta a save holds, save),
what follows each published step (`AfterStep`: the next evaluation round asked, finished rounds
written, the placement's own hook, a checkpoint when due), its metrics writer, and the end of its
run (the last evaluation round, the reward PNG).

The embedded placement (dora_jax.runtime.runner) takes the coordinator's state for a checkpoint
from the in-process Coordinator; the process placement (dora_jax.runtime.placements.trainer_process) from its
`Snapshot` call, host 0 handing the meta to the other hosts of a multi-host trainer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from dora_jax.core import fs
from dora_jax.runtime import faults, resume
from dora_jax.runtime.checkpoint import Restored, RunCheckpointer, abstract_like
from dora_jax.runtime.evaluator import Evaluator
from dora_jax.runtime.metrics import MetricsWriter, WandbSpec, draw_reward_curve
from dora_jax.runtime.run_config import RunConfig

log = logging.getLogger(__name__)

ROW_FILES = ("metrics.jsonl", "eval_samples.jsonl")  # rows by step, rewritten after a resume


def warmup(config: RunConfig, trainer) -> list[int]:
    """With `compile_ahead`, compiles every train-step shape a batch can take (returns the
    micro-batch lengths); without it, nothing (each compiles when first used)."""
    if not config.compile_ahead:
        return []
    return trainer.warmup(config.rollout.cache_length, config.coordinator.train_batch_size, config.pad_to)


def restore(checkpointer: RunCheckpointer, trainer, store, fingerprint: dict) -> Restored | None:
    """Loads the newest checkpoint that restores into `trainer` and publishes its versions to
    `store`; None when there is none (the run starts over). A checkpoint of another config or
    model is refused (dora_jax.runtime.resume.check_resumable)."""
    restored = checkpointer.restore_latest(
        lambda: abstract_like(trainer.state, trainer.state_shardings),
        lambda: abstract_like(trainer.params, trainer.param_shardings),
    )
    if restored is None:
        return None
    resume.check_resumable(restored.meta["fingerprint"], fingerprint)
    trainer.load_state(restored.trainer_state, restored.meta["trainer_version"])
    for version in sorted(restored.versions):
        store.publish(version, restored.versions[version])
    return restored


def coordinator_state(restored: Restored | None) -> dict | None:
    """What a restored checkpoint holds for the coordinator (dora_jax.runtime.roles.coordinator.restore)."""
    if restored is None:
        return None
    return {"coordinator": restored.meta["coordinator"], "prompts": restored.meta["prompts"]}


def checkpoint_meta(state: dict, trainer_version: int, fingerprint: dict) -> dict:
    """A checkpoint's meta from the coordinator's snapshot taken at `trainer_version` (its
    `extra` holds the live prompts, which the meta keeps apart)."""
    prompts = state["extra"].pop("prompts")
    return resume.meta(state, trainer_version, prompts, fingerprint)


def save(checkpointer: RunCheckpointer, trainer, store, meta: dict) -> None:
    """Starts the checkpoint of the trainer's version: its state, the versions the meta names
    (what unconsumed work still needs) and the meta. Raises CheckpointError or OSError."""
    versions = {v: store.get(v, trainer.param_shardings, copy=False) for v in meta["versions"]}
    faults.before_checkpoint_save()
    checkpointer.save(trainer.version, trainer.state, versions, meta)
    faults.reached("checkpoint_save")


def trim_rows(workdir: str, start_step: int) -> None:
    """A run resumed at `start_step` writes its rows again from there."""
    for name in ROW_FILES:
        resume.trim_rows(fs.join(workdir, name), start_step)


def open_writer(config: RunConfig, workdir: str, config_json: dict | None) -> MetricsWriter:
    return MetricsWriter(workdir, tensorboard=config.tensorboard, wandb=WandbSpec.of(config.log), config=config_json)


def close_writer(writer: MetricsWriter, workdir: str) -> str | None:
    """Draws the reward PNG, hands it to the trackers and closes them; returns its path."""
    curve = draw_reward_curve(workdir)
    writer.close(images={"reward_curve": curve} if curve else None)
    return curve


class AfterStep:
    """`training_loop.train`'s `after_step`, the same in every placement: the next version's
    evaluation round asked (right after its publish), finished rounds written, the placement's
    `hook(step)` (the embedded run's injected slice faults), then `checkpoint(step)`'s row fields."""

    def __init__(
        self,
        evaluator: Evaluator | None,
        checkpoint: Callable[[int], dict],
        hook: Callable[[int], None] | None = None,
    ):
        self._evaluator, self._checkpoint, self._hook = evaluator, checkpoint, hook

    def __call__(self, step: int) -> dict:
        if self._evaluator is not None:
            self._evaluator.maybe_request(step + 1)
            self._evaluator.harvest()
        if self._hook is not None:
            self._hook(step)
        return self._checkpoint(step)


def finish_evaluation(evaluator: Evaluator | None, timeout_s: float) -> None:
    """Waits up to `timeout_s` for the last version's round (the run's last evaluation row)."""
    if evaluator is None:
        return
    evaluator.harvest(timeout=timeout_s)
    if evaluator.pending:
        log.warning("%d evaluation rounds did not finish; their rows are missing", evaluator.pending)
