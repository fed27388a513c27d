"""The rollout slice role, for every placement: the served model's shapes, the slice's engine
on its mesh, and the worker over that engine (a restarted slice gets a fresh worker on the same,
warm engine). The embedded placement (dora_jax.runtime.runner) runs the worker on a thread behind
an in-process port; the process placement (dora_jax.runtime.placements.rollout_process) behind a `RolloutAgent`
speaking gRPC, its versions fetched from the tensorstore tier or pulled device to device.
"""

from __future__ import annotations

import functools

from dora_jax import models
from dora_jax.rollout.engine import RolloutEngine
from dora_jax.rollout.scoring import TrajectoryScorer
from dora_jax.rollout.worker import RolloutWorker
from dora_jax.runtime.build import fresh_model_config
from dora_jax.runtime.run_config import RunConfig
from dora_jax.trainer import TrainerConfig
from dora_jax.trainer.step import sequence_logps


def model_config(config: RunConfig, tokenizer) -> models.ModelConfig:
    """The served model's shapes, without its weights (those come from the store): the HF
    checkpoint's config.json, or the fresh model the trainer cold-starts."""
    start = config.init.checkpoint or config.model.hf_path
    if start:
        return models.read_config(
            start,
            dtype=models.dtype_from_name(config.model.dtype),
            param_dtype=models.dtype_from_name(config.model.param_dtype),
        )
    return fresh_model_config(config, tokenizer.vocab_size, tokenizer.eos_ids)


def build_engine(config: RunConfig, served: models.ModelConfig, mesh, tokenizer) -> RolloutEngine:
    """The slice's engine over its own mesh (its own sharding rules, ROLLOUT_RULES)."""
    return RolloutEngine(served, config.rollout.engine_config(), mesh, tokenizer=tokenizer)


def make_worker(
    config: RunConfig, engine: RolloutEngine, slice_id: int, eos_ids, scorer: TrajectoryScorer | None = None
) -> RolloutWorker:
    """A worker for slice `slice_id` on `engine` (nothing loaded, nothing in flight). `scorer`: the
    slice's scorer kept across restarts (its programs stay compiled); None: `make_scorer`'s."""
    return RolloutWorker(
        engine,
        slice_id=slice_id,
        eos_ids=tuple(eos_ids),
        migration=config.rollout.migration_costs(),
        scorer=scorer or make_scorer(config.trainer, engine),
    )


def make_scorer(trainer: TrainerConfig, engine: RolloutEngine) -> TrajectoryScorer | None:
    """Under `trainer.behaviour_logps = "rollout"`: the slice's scorer of finished trajectories,
    the trainer's own forward (`sequence_logps` with its vocab_chunk and temperature) on the slice's
    mesh, `trainer.micro_batch_size` rows a call at most (as the trainer's recompute); None under
    "trainer"."""
    if trainer.behaviour_logps != "rollout":
        return None
    forward = functools.partial(sequence_logps, vocab_chunk=trainer.vocab_chunk, temperature=trainer.temperature)
    return TrajectoryScorer(
        lambda graphdef, params, tokens_NT: forward(graphdef, params, tokens_NT)[0],
        engine.graphdef,
        engine.param_shardings,
        engine.mesh,
        engine.rules,
        # at most the trainer's recompute chunk a call: its memory is the recompute's, not the slots'
        max_rows=min(engine.max_concurrent_decodes, trainer.micro_batch_size),
        max_length=engine.config.cache_length,  # no trajectory is longer: its widest bucket
    )


def warmup(config: RunConfig, engine: RolloutEngine, scorer: TrajectoryScorer | None, params) -> None:
    """With `compile_ahead`, compiles every engine program and every scoring bucket (a slice that
    scores, `trainer.behaviour_logps = "rollout"`) before the first dispatch; without it, nothing:
    each program compiles when first used."""
    if not config.compile_ahead:
        return
    engine.warmup(params)
    if scorer is not None:
        scorer.warmup(engine.load_params(params), config.rollout.cache_length)
