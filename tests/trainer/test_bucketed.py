"""Length-bucketed micro-batches (`trainer.length_bucket`) == the fixed-shape step, on 8 fake devices."""

import dataclasses

import jax
import numpy as np
import pytest

from dora_jax import sharding
from dora_jax.records import TrainBatch
from dora_jax.store import InProcessTier, ParamStore
from dora_jax.trainer import Trainer
from dora_jax.trainer.bucketed import micro_plan, row_lengths
from tests.trainer.test_trainer import CFG, CONFIG, FAST_COMPILE, G, host, model  # noqa: F401  (fixture)

B, T = 16, 64


def long_tailed_batch(seed: int, versions) -> TrainBatch:
    """Rows of 8..64 positions, most short: what bucketing is for."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(8 + rng.geometric(0.15, B), T)
    lengths[3] = T  # one row of the full length
    tokens = rng.integers(1, CFG.vocab_size, (B, T)).astype(np.int32)
    loss_mask = np.zeros((B, T), np.float32)
    for b, n in enumerate(lengths):
        tokens[b, n:] = 0
        loss_mask[b, 5:n] = 1
    rewards = rng.integers(0, 2, B).astype(np.float32)
    rewards[:G] = 1.0  # a zero-variance group for dynamic sampling
    valid = np.ones(B, np.float32)
    valid[6] = 0.0
    inference = np.where(loss_mask > 0, -np.log(CFG.vocab_size) + rng.normal(0, 0.1, (B, T)), 0.0)
    return TrainBatch(
        tokens_BT=tokens, loss_mask_BT=loss_mask, inference_logps_BT=inference.astype(np.float32),
        rewards_B=rewards, valid_B=valid, versions_B=np.broadcast_to(np.asarray(versions), (B,)).copy(),
        group_ids_B=np.arange(B, dtype=np.int32) // G, traj_ids=tuple(f"t{i}" for i in range(B)),
    )


def test_micro_plan_sorts_within_each_update_and_pads_each_micro_batch_to_its_bucket():
    lengths = np.array([5, 40, 9, 17, 3, 64, 8, 30])
    plan = micro_plan(lengths, num_updates=2, micro_batch_size=2, pad_to=8)
    assert [[(list(rows), t) for rows, t in update] for update in plan] == [
        [([1, 3], 64), ([2, 0], 16)],  # update 0 holds rows 0-3 only
        [([5, 7], 64), ([6, 4], 8)],
    ]
    batch = long_tailed_batch(0, 0)
    assert row_lengths(batch)[3] == T and (row_lengths(batch) <= T).all()


@pytest.mark.parametrize("loss_norm", ["seq_mean_token_mean", "token_mean"])
def test_bucketed_steps_equal_fixed_shape_steps(model, loss_norm):  # noqa: F811
    graphdef, params, axes = model
    mesh = sharding.make_mesh(jax.devices(), {"fsdp": 4, "tensor": 2})
    config = dataclasses.replace(CONFIG, loss_norm=loss_norm)
    trainers = {}
    for name, bucket in (("fixed", 0), ("bucketed", 8)):
        store = ParamStore(InProcessTier())
        trainers[name] = Trainer(graphdef, params, axes, mesh, dataclasses.replace(config, length_bucket=bucket), store,
                                 compiler_options=FAST_COMPILE)
        trainers[name].publish()
    assert trainers["bucketed"].warmup(T, B) == [8, 16, 32, 64] and trainers["fixed"].warmup(T, B) == []
    warm = trainers["bucketed"].trace_counts["bucketed"]
    metrics = {name: [] for name in trainers}
    for step, versions in enumerate([0, np.arange(B) % 2]):  # the second step mixes versions 0 and 1
        batch = long_tailed_batch(step, versions)
        for name, trainer in trainers.items():
            metrics[name].append(trainer.train_step(batch))
            trainer.publish()
    for fixed, bucketed in zip(metrics["fixed"], metrics["bucketed"]):
        assert fixed.dropped_groups == bucketed.dropped_groups >= 1 and fixed.loss_tokens == bucketed.loss_tokens
        for field in ("loss", "grad_norm", "ratio_mean", "ratio_max", "tis_mean", "entropy", "kl", "clip_frac_high"):
            np.testing.assert_allclose(getattr(bucketed, field), getattr(fixed, field), rtol=1e-4, atol=1e-6, err_msg=field)
    for a, b in zip(jax.tree.leaves(host(trainers["bucketed"].params)), jax.tree.leaves(host(trainers["fixed"].params))):
        # as in test_trainer: Adam's sqrt(v) turns fp32 summation-order noise into <= 2% of lr
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=0.02 * config.lr)
        assert np.abs(a - b).mean() < 1e-7
    assert warm == 4 and trainers["bucketed"].trace_counts["bucketed"] == warm  # warmup compiled every shape
