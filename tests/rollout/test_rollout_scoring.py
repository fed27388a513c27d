"""Behaviour log-probs scored on the rollout slice (dora_jax.rollout.scoring): they equal the
trainer's recompute of the same rows, dense and MoE, on one device and tensor parallel, as the
engine's sampling log-probs do (trainer.behaviour_logps = "sampler"); the
scoring compiles per bucket, not per length; a worker without a scorer scores nothing."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from dora_jax.core.records import Group, Request, SamplingParams, ScoredTrajectory
from dora_jax.models import init_model, logical_axes, split
from dora_jax.parallel import sharding
from dora_jax.rollout.engine import RolloutEngine
from dora_jax.rollout.scoring import bucket
from dora_jax.rollout.worker import RolloutWorker
from dora_jax.runtime.roles.rollout import make_scorer
from dora_jax.store.digest import params_digest
from dora_jax.trainer import Trainer, TrainerConfig
from dora_jax.trainer.batching import make_train_batch
from tests.rollout.conftest import ENGINE, TINY, run_to_end

MOE = TINY.replace(model_type="qwen3_moe", qk_norm=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
TEMPERATURE = 0.7
# Both sides slice the vocabulary (96 entries) 32 at a time, as the trainer's config says.
SCORING = TrainerConfig(behaviour_logps="rollout", temperature=TEMPERATURE, vocab_chunk=32, micro_batch_size=4)
PROMPTS = [[1, 5, 9], [7, 3, 11, 4, 8], [12, 6], [1, 2 + 7, 30, 31, 40, 41, 50], [9, 9, 9, 9], [60, 61, 62]]
MAX_NEW = [14, 5, 21, 9, 3, 17]  # finishing in different steps: several scoring calls, several lengths


def _generate(engine, params, scorer) -> list:
    """The trajectories of PROMPTS sampled at TEMPERATURE (no EOS: each runs to its MAX_NEW)."""
    worker = RolloutWorker(engine, eos_ids=(), scorer=scorer)
    digest = worker.load_version(0, params)
    for i, (prompt, max_new) in enumerate(zip(PROMPTS, MAX_NEW, strict=True)):
        sampling = SamplingParams(temperature=TEMPERATURE, seed=10 + i)
        worker.submit(Request(f"t{i}", "g", f"p{i}", tuple(prompt), 0, max_new, sampling))
    done = run_to_end(worker)
    assert worker.counters.scored == (len(PROMPTS) if scorer is not None else 0)
    return [done[f"t{i}"] for i in range(len(PROMPTS))], digest


def _trainer_recompute(model_config, params, trajectories) -> np.ndarray:
    """The trainer's behaviour log-probs of `trajectories` (its BehaviourLogps, version 0 = its own
    params), on a one-device trainer mesh apart from the rollout slices."""
    model = init_model(model_config, seed=3)
    graphdef, _ = split(model)
    mesh = sharding.make_mesh(jax.devices()[7:8], {})
    trainer = Trainer(graphdef, params, logical_axes(model), mesh, SCORING)
    samples = tuple(ScoredTrajectory(t, 1.0) for t in trajectories)
    batch = make_train_batch([Group("g", 0, samples)], 8, 0, num_rows=8)
    return batch, trainer.behaviour_logps(batch)


@pytest.mark.parametrize(
    "model_config, devices, shape",
    [(TINY, 1, {}), (TINY, 2, {"tensor": 2}), (MOE, 2, {"tensor": 2})],
    ids=["dense_one_device", "dense_tensor_parallel", "moe_tensor_parallel"],
)
def test_rollout_scores_equal_the_trainer_recompute(model_config, devices, shape):
    """Each finished trajectory's slice-scored behaviour log-probs equal, per token within 1e-5
    (fp32), the trainer's recompute of that row under the same version; the digest that comes with
    them is the loaded params'."""
    params = split(init_model(model_config, seed=3))[1]
    engine = RolloutEngine(model_config, ENGINE, sharding.make_mesh(jax.devices()[1 : 1 + devices], shape))
    scorer = make_scorer(SCORING, engine)
    trajectories, digest = _generate(engine, params, scorer)
    assert digest == params_digest(engine.load_params(params))
    batch, want_BT = _trainer_recompute(model_config, params, trajectories)
    for b, traj in enumerate(trajectories):
        start, n = len(traj.prompt_ids), traj.num_tokens
        assert n == MAX_NEW[b] and len(traj.behaviour_logprobs) == n
        assert traj.behaviour_digest == digest
        got = np.asarray(traj.behaviour_logprobs)
        np.testing.assert_allclose(got, want_BT[b, start : start + n], atol=1e-5, rtol=0)
        # The engine's own log-probs of the tokens it sampled agree as closely (trainer.behaviour_logps
        # = "sampler" takes those: 4.8e-7 at most here).
        np.testing.assert_allclose(np.asarray(traj.logprobs), want_BT[b, start : start + n], atol=1e-5, rtol=0)
        assert np.all(got <= 0) and np.all(np.isfinite(got))
        np.testing.assert_allclose(batch.behaviour_logps_BT[b, start : start + n], got)
    assert batch.behaviour_known_B.tolist() == [True] * len(PROMPTS) + [False] * 2
    # Rows of one bucket in every call; the buckets of lengths 3..28 positions are 16 and 32.
    assert scorer.traces <= 2 * 3


def test_scoring_compiles_per_bucket_not_per_length(engine, tiny_params):
    """Warm-up compiles every (rows, length) bucket once; trajectories of many lengths afterwards
    add no program."""
    scorer = make_scorer(SCORING, engine)
    params = engine.load_params(tiny_params)
    compiled = scorer.warmup(params, 64)
    assert compiled == scorer.traces == 3 * 3  # rows 1, 2, 4 x positions 16, 32, 64
    for size in range(1, 9):
        rows = [([1, 2, 3], list(range(4, 4 + 7 * size)))] * (size % 4 + 1)
        out = scorer(params, rows)
        assert [len(x) for x in out] == [7 * size] * len(rows)
    assert scorer.traces == 9
    assert [bucket(n, 16) for n in (1, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]


def test_the_widest_scoring_bucket_is_the_cache_length(tiny_params):
    """A slice whose cache length is not a power of two pads its longest trajectories to that
    length, not to the next power of two (as the trainer caps its buckets at its batch width):
    warm-up compiles positions 16, 32 and 48 (not 64), and a 40-position trajectory scores in the
    48 bucket to the same log-probs as in the 64 bucket."""
    mesh = sharding.make_mesh(jax.devices()[:1], {})
    engine = RolloutEngine(TINY, dataclasses.replace(ENGINE, cache_length=48), mesh)
    scorer = make_scorer(SCORING, engine)
    assert scorer.max_length == 48
    assert [scorer.shape(1, n)[1] for n in (16, 17, 33, 40, 48)] == [16, 32, 48, 48, 48]
    params = engine.load_params(tiny_params)
    assert scorer.warmup(params, 48) == 3 * 3  # rows 1, 2, 4 x positions 16, 32, 48
    rows = [([1, 2, 3], list(range(4, 41))), ([5, 6], list(range(7, 30)))]
    capped = scorer(params, rows)
    assert scorer.traces == 9  # the 40-position call took a warmed bucket
    scorer.max_length = None  # the same scorer, uncapped: the 64 bucket
    assert scorer.shape(2, 40) == (2, 64)
    uncapped = scorer(params, rows)
    for got, want in zip(capped, uncapped, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_no_scorer_means_no_behaviour_logprobs(warm_engine, tiny_params):
    """Under trainer.behaviour_logps = "trainer" the role builds no scorer, and the worker's
    trajectories carry no behaviour log-probs (the trainer recomputes them all)."""
    assert make_scorer(TrainerConfig(), warm_engine) is None
    trajectories, _ = _generate(warm_engine, tiny_params, None)
    assert all(t.behaviour_logprobs is None and t.behaviour_digest is None for t in trajectories)
