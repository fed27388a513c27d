"""Length-bucketed micro-batches (`trainer.length_bucket`) == the fixed-shape step, on 8 fake devices."""

import dataclasses

import jax
import numpy as np
import pytest

from dora_jax.core.records import TrainBatch
from dora_jax.parallel import sharding
from dora_jax.store import InProcessTier, ParamStore
from dora_jax.trainer import Trainer
from dora_jax.trainer.batching import bucket_length
from dora_jax.trainer.bucketed import bucket_lengths, micro_plan, row_lengths
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
        tokens_BT=tokens,
        loss_mask_BT=loss_mask,
        inference_logps_BT=inference.astype(np.float32),
        rewards_B=rewards,
        valid_B=valid,
        versions_B=np.broadcast_to(np.asarray(versions), (B,)).copy(),
        group_ids_B=np.arange(B, dtype=np.int32) // G,
        traj_ids=tuple(f"t{i}" for i in range(B)),
    )


def test_micro_plan_sorts_within_each_update_and_pads_each_micro_batch_to_its_bucket():
    lengths = np.array([5, 40, 9, 17, 3, 64, 8, 30])
    plan = micro_plan(lengths, num_updates=2, micro_batch_size=2, pad_to=8)
    assert [[(list(rows), t, size) for rows, t, size in update] for update in plan] == [
        [([1, 3], 64, 2), ([2, 0], 16, 2)],  # update 0 holds rows 0-3 only
        [([5, 7], 64, 2), ([6, 4], 8, 2)],
    ]
    batch = long_tailed_batch(0, 0)
    assert row_lengths(batch)[3] == T and (row_lengths(batch) <= T).all()


def test_micro_plan_caps_lengths_at_the_batch_width_and_warmup_lists_those_lengths():
    lengths = np.array([43, 3, 20, 5])
    plan = micro_plan(lengths, num_updates=1, micro_batch_size=2, pad_to=8, width=44)
    assert [(list(rows), t) for rows, t, _ in plan[0]] == [([0, 2], 44), ([3, 1], 8)]  # not 64: the batch is 44 wide
    assert bucket_lengths(43, 8, (44,)) == [8, 16, 32, 44]
    assert bucket_lengths(100, 8, (44, 88, 176)) == [8, 16, 32, 44, 64, 88, 128]
    assert bucket_lengths(64, 8) == [8, 16, 32, 64]


def test_token_budget_gives_long_rows_small_micro_batches_and_short_rows_large_ones():
    lengths = np.array([300, 10, 12, 150, 9, 40, 8, 7, 11, 60, 13, 6, 5, 14, 9, 10])
    plan = micro_plan(lengths, num_updates=1, micro_batch_size=4, pad_to=16, width=344, token_budget=1024, shards=2)
    # Every row is planned once; each micro-batch is as long as its longest row's bucket and no
    # bigger than the budget allows (at least one row per shard).
    rows = np.concatenate([m.rows for m in plan[0]])
    assert sorted(rows.tolist()) == list(range(lengths.size))
    for m in plan[0]:
        assert m.rows.size <= m.size and m.length == bucket_length(int(lengths[m.rows].max()), 16, 344)
        assert m.size == 2 or m.size * m.length <= 1024
        assert m.size % 2 == 0
    assert [(m.length, m.size) for m in plan[0]] == [(344, 2), (64, 16)]
    assert [lengths[m.rows].tolist() for m in plan[0]] == [
        [300, 150],
        [60, 40, 14, 13, 12, 11, 10, 10, 9, 9, 8, 7, 6, 5],
    ]


@pytest.mark.slow
@pytest.mark.parametrize("loss_norm", ["seq_mean_token_mean", "token_mean"])
def test_bucketed_steps_equal_fixed_shape_steps(model, loss_norm):  # noqa: F811
    graphdef, params, axes = model
    mesh = sharding.make_mesh(jax.devices(), {"fsdp": 4, "tensor": 2})
    config = dataclasses.replace(CONFIG, loss_norm=loss_norm)
    trainers = {}
    # "budget": micro-batches of 128 positions over the mesh's 4 batch shards: 4 rows at length 32
    # or 64 (fewer than its micro_batch_size of 8), 8 (one whole update) at length 8 or 16.
    for name, bucket, budget, rows in (("fixed", 0, 0, 4), ("bucketed", 8, 0, 4), ("budget", 8, 128, 8)):
        store = ParamStore(InProcessTier())
        replace = dict(length_bucket=bucket, micro_batch_tokens=budget, micro_batch_size=rows)
        trainers[name] = Trainer(
            graphdef, params, axes, mesh, dataclasses.replace(config, **replace), store, compiler_options=FAST_COMPILE
        )
        trainers[name].publish()
    assert trainers["bucketed"].warmup(T, B) == [8, 16, 32, 64] and trainers["fixed"].warmup(T, B) == []
    assert trainers["budget"].warmup(T, B, pad_to=T) == [8, 16, 32, 64]
    warm = {name: trainers[name].trace_counts["bucketed"] for name in ("bucketed", "budget")}
    metrics = {name: [] for name in trainers}
    for step, versions in enumerate([0, np.arange(B) % 2]):  # the second step mixes versions 0 and 1
        batch = long_tailed_batch(step, versions)
        plan = micro_plan(row_lengths(batch), 2, 8, 8, width=T, token_budget=128, shards=4)
        sizes = {(m.length, m.size, m.rows.size) for update in plan for m in update}
        assert {(64, 4, 4), (16, 8, 4)} <= sizes, sizes  # small micro-batches for long rows; padding rows
        for name, trainer in trainers.items():
            metrics[name].append(trainer.train_step(batch))
            trainer.publish()
    for name in ("bucketed", "budget"):
        for fixed, bucketed in zip(metrics["fixed"], metrics[name]):
            assert fixed.dropped_groups == bucketed.dropped_groups >= 1 and fixed.loss_tokens == bucketed.loss_tokens
            for field in (
                "loss",
                "grad_norm",
                "ratio_mean",
                "ratio_min",
                "ratio_max",
                "tis_mean",
                "tis_max",
                "entropy",
                "kl",
                "clip_frac_high",
            ):
                np.testing.assert_allclose(
                    getattr(bucketed, field), getattr(fixed, field), rtol=1e-4, atol=1e-6, err_msg=f"{name}: {field}"
                )
        for a, b in zip(jax.tree.leaves(host(trainers[name].params)), jax.tree.leaves(host(trainers["fixed"].params))):
            # as in test_trainer: Adam's sqrt(v) turns fp32 summation-order noise into <= 2% of lr
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=0.02 * config.lr, err_msg=name)
            assert np.abs(a - b).mean() < 1e-7
        assert trainers[name].trace_counts["bucketed"] == warm[name] == 4, name  # warmup compiled every shape


@pytest.mark.slow
def test_sampler_behaviour_logps_warm_up_and_lower_no_recompute_program(model):  # noqa: F811
    """trainer.behaviour_logps = "sampler" never recomputes, so `warmup` compiles and
    `lower_bucketed` lowers the gradient programs alone; a mixed-version step after the warm-up
    traces nothing new. The recomputing trainer warms up a recompute program per length."""
    graphdef, params, axes = model
    mesh = sharding.make_mesh(jax.devices()[:2], {"fsdp": 2})
    names, traces = {}, {}
    for source in ("trainer", "sampler"):
        config = dataclasses.replace(CONFIG, length_bucket=8, behaviour_logps=source)
        trainer = Trainer(
            graphdef, params, axes, mesh, config, ParamStore(InProcessTier()), compiler_options=FAST_COMPILE
        )
        trainer.publish()
        assert trainer.warmup(T, B) == [8, 16, 32, 64]
        traces[source] = dict(trainer.trace_counts)
        if source == "sampler":
            trainer.train_step(long_tailed_batch(0, 0))
            trainer.publish()
            metrics = trainer.train_step(long_tailed_batch(1, np.arange(B) % 2))  # versions 0 and 1
            assert (metrics.recomputed_rows, metrics.sampler_rows) == (0, B)
            assert dict(trainer.trace_counts) == traces["sampler"]  # nothing compiled after the warm-up
        names[source] = [name for name, _ in trainer.lower_bucketed(B, T)]  # (lowering traces again)
    assert traces["trainer"]["recompute"] == 4 and traces["trainer"]["bucketed"] == 4
    assert traces["sampler"].get("recompute", 0) == 0 and traces["sampler"]["bucketed"] == 4
    recompute = [f"recompute[rows=4,T={t}]" for t in (8, 16, 32, 64)]
    assert [n for n in names["trainer"] if n.startswith("recompute[")] == recompute
    assert names["sampler"] == [n for n in names["trainer"] if not n.startswith("recompute[")]
