"""trainer.grad_ahead: gradients of committed groups computed while the trainer waits, joined with
the rest of the batch at the step, equal the plain step's; held sums the batch does not hold as
they were are dropped, never used."""

import dataclasses

import jax
import numpy as np
import pytest

from dora_jax.core.records import TrainBatch
from dora_jax.parallel import sharding
from dora_jax.store import InProcessTier, ParamStore
from dora_jax.trainer import Trainer, TrainerConfig
from dora_jax.trainer.bucketed import row_lengths
from dora_jax.trainer.loss import LOSS_NORMS, row_weights, token_weights, weights_scale
from tests.trainer.test_bucketed import long_tailed_batch
from tests.trainer.test_trainer import CONFIG, FAST_COMPILE, G, host, model  # noqa: F401  (fixture)

B, T = 16, 64
FIELDS = ("loss", "grad_norm", "ratio_mean", "ratio_min", "ratio_max", "tis_mean", "entropy", "kl", "clip_frac_high")


@pytest.mark.parametrize("loss_norm", LOSS_NORMS)
def test_row_weights_times_the_batch_scale_are_the_token_weights(loss_norm):
    rng = np.random.default_rng(0)
    mask = (rng.random((12, 40)) < 0.6).astype(np.float32)
    mask[3] = 0.0  # an empty row
    product = np.asarray(row_weights(mask, loss_norm)) * np.asarray(weights_scale(mask, loss_norm, 512))
    np.testing.assert_allclose(product, np.asarray(token_weights(mask, loss_norm, 512)), rtol=1e-6, atol=0)
    assert product.sum() > 0


def test_grad_ahead_needs_what_it_relies_on():
    with pytest.raises(ValueError, match=r"trainer.grad_ahead=True needs trainer.length_bucket > 0 .*num_updates = 1"):
        TrainerConfig(grad_ahead=True, num_updates=2)
    with pytest.raises(ValueError, match=r"trainer.score_ahead = False"):
        TrainerConfig(grad_ahead=True, length_bucket=8, score_ahead=True)


def packed(batch: TrainBatch, rows, width: int) -> TrainBatch:
    """`batch`'s `rows` (whole groups) packed first in a batch of their own, `width` positions wide,
    the rest padding rows (as the training loop packs the groups a commit shows)."""
    rows = np.asarray(rows)

    def take(x, fill=0):
        x = np.asarray(x)
        out = np.full((batch.batch_size,) + ((width,) if x.ndim == 2 else ()), fill, x.dtype)
        if x.ndim == 2:
            out[: rows.size, : min(width, x.shape[1])] = x[rows, :width]
        else:
            out[: rows.size] = x[rows]
        return out

    group_ids = np.arange(batch.batch_size, dtype=np.int32)  # padding rows: groups of their own
    group_ids[: rows.size] = np.unique(batch.group_ids_B[rows], return_inverse=True)[1]
    return TrainBatch(
        tokens_BT=take(batch.tokens_BT),
        loss_mask_BT=take(batch.loss_mask_BT),
        inference_logps_BT=take(batch.inference_logps_BT),
        rewards_B=take(batch.rewards_B),
        valid_B=take(batch.valid_B),
        versions_B=take(batch.versions_B),
        group_ids_B=group_ids,
        traj_ids=tuple(batch.traj_ids[r] for r in rows) + ("",) * (batch.batch_size - rows.size),
    )


def trainer_at_version_1(model, config):  # noqa: F811
    graphdef, params, axes = model
    mesh = sharding.make_mesh(jax.devices()[:2], {"fsdp": 2})
    own = jax.tree.map(np.array, params)  # with kl_coef 0 the trainer donates (deletes) what it is given
    trainer = Trainer(graphdef, own, axes, mesh, config, ParamStore(InProcessTier()), compiler_options=FAST_COMPILE)
    trainer.publish()
    trainer.train_step(long_tailed_batch(9, 0))
    trainer.publish()
    return trainer


@pytest.mark.parametrize(
    "loss_norm,behaviour",
    [
        ("token_mean", "trainer"),
        pytest.param("seq_mean_token_mean", "trainer", marks=pytest.mark.slow),
        pytest.param("constant", "sampler", marks=pytest.mark.slow),
    ],
)
def test_gradients_computed_ahead_give_the_plain_step(model, loss_norm, behaviour):  # noqa: F811
    """Versions 0 and 1 mixed (the trainer is at 1: version-0 rows are recomputed ahead, version-1
    rows take the gradient forward's own); two commits of whole groups (one holding DAPO's dropped
    group and an invalid row), packed at another width; a commit shown again adds nothing. The
    step computes the other rows and equals the plain step: metrics, digests and params."""
    base = long_tailed_batch(4, np.arange(B) % 2)
    config = dataclasses.replace(
        CONFIG, loss_norm=loss_norm, behaviour_logps=behaviour, num_updates=1, length_bucket=8, micro_batch_tokens=128
    )

    def run(ahead: bool):
        trainer = trainer_at_version_1(model, dataclasses.replace(config, grad_ahead=ahead))
        if ahead:
            first = packed(base, np.arange(0, 2 * G), 2 * T)  # groups 0 (no reward variance) and 1
            assert trainer.grad_ahead(first) == 2 * G and trainer.grad_ahead(first) == 0
            assert trainer.grad_ahead(packed(base, np.arange(2 * G, 3 * G), T)) == G  # group 2
        return trainer.train_step(base), host(trainer.params)

    (plain, params_p), (ahead, params_a) = run(False), run(True)
    assert (plain.grad_ahead_rows, ahead.grad_ahead_rows, ahead.grad_ahead_dropped) == (0, 3 * G, 0)
    assert ahead.recomputed_rows == plain.recomputed_rows == (B // 2 if behaviour == "trainer" else 0)
    assert ahead.behaviour_digests == plain.behaviour_digests
    assert ahead.dropped_groups == plain.dropped_groups >= 1 and ahead.loss_tokens == plain.loss_tokens
    for field in FIELDS:
        np.testing.assert_allclose(getattr(ahead, field), getattr(plain, field), rtol=1e-4, atol=1e-6, err_msg=field)
    for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_p)):
        # as in test_trainer: Adam's sqrt(v) turns fp32 summation-order noise into <= 2% of lr
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=0.02 * CONFIG.lr)
        assert np.abs(a - b).mean() < 1e-7


@pytest.mark.slow
def test_held_gradients_the_batch_does_not_hold_as_they_were_are_dropped(model):  # noqa: F811
    """A batch whose row differs from the one computed ahead (its reward changed), or that lacks a
    held row, or a step at another version: the held sums are dropped (counted), and the step is
    the plain one. All rows of a batch computed ahead: the step only joins them."""
    config = dataclasses.replace(CONFIG, num_updates=1, length_bucket=8, loss_norm="token_mean")
    base = long_tailed_batch(4, np.arange(B) % 2)
    other = dataclasses.replace(base, rewards_B=np.where(np.arange(B) == 1, 1.0 - base.rewards_B, base.rewards_B))

    plain = trainer_at_version_1(model, config)
    ahead = trainer_at_version_1(model, dataclasses.replace(config, grad_ahead=True))

    def step(batch, held: int, dropped: int):
        want, got = plain.train_step(batch), ahead.train_step(batch)
        assert (got.grad_ahead_rows, got.grad_ahead_dropped) == (held, dropped)
        for field in FIELDS:
            np.testing.assert_allclose(getattr(got, field), getattr(want, field), rtol=1e-4, atol=1e-6, err_msg=field)
        for a, b in zip(jax.tree.leaves(host(ahead.params)), jax.tree.leaves(host(plain.params))):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=0.02 * CONFIG.lr)
        plain.publish(), ahead.publish()
        return got

    assert ahead.grad_ahead(packed(base, np.arange(0, 2 * G), T)) == 2 * G
    step(other, 0, 2 * G)  # row 1's reward differs: group 0's advantages differ
    # Held at version 2, then a batch without those rows: dropped.
    assert ahead.grad_ahead(packed(base, np.arange(0, G), T)) == G
    step(dataclasses.replace(base, traj_ids=tuple(f"x{i}" for i in range(B))), 0, G)
    # Held at version 3, and a publish the trainer did not make moves nothing: at version 3 still.
    # Every row computed ahead, in two commits: the step only joins them.
    full = dataclasses.replace(base, versions_B=np.where(np.arange(B) % 2 == 0, 2, 3))
    assert ahead.grad_ahead(packed(full, np.arange(B // 2), T)) == B // 2
    assert ahead.grad_ahead(packed(full, np.arange(B // 2, B), T)) == B // 2
    done = step(full, B, 0)
    assert done.recomputed_rows == B // 2  # the version-2 rows, recomputed ahead
    # Held at version 4 and the step comes at another version: dropped (a trainer restored from a
    # checkpoint, say).
    assert ahead.grad_ahead(packed(full, np.arange(G), T)) == G
    ahead.load_state(ahead.state, 5)
    assert ahead.train_step(full).grad_ahead_dropped == G


@pytest.mark.slow
def test_full_only_computes_the_micro_batches_the_rows_fill_and_the_step_the_rest(model):  # noqa: F811
    """`grad_ahead(full_only=True)` (the training loop's way): of the rows not held yet, only those
    of micro-batches they fill are computed (a micro-batch of a few real rows costs a full one);
    passing the committed groups again with more computes more; the step computes the rest and
    equals the plain step."""
    config = dataclasses.replace(
        CONFIG, num_updates=1, length_bucket=8, micro_batch_tokens=128, loss_norm="token_mean", kl_coef=0.0
    )
    base = long_tailed_batch(5, np.arange(B) % 2)
    plain = trainer_at_version_1(model, config)
    want = plain.train_step(base)
    ahead = trainer_at_version_1(model, dataclasses.replace(config, grad_ahead=True))

    def expected(rows) -> int:  # rows of the micro-batches that those of `rows` not held yet fill
        batch, held = packed(base, rows, T), ahead._held.keys if ahead._held else {}
        free = np.flatnonzero([bool(t) and t not in held for t in batch.traj_ids])
        plan = ahead._bucketed._plan_rows(row_lengths(batch), free, T, B)
        return sum(m.rows.size for m in plan if m.rows.size == m.size)

    held, calls = 0, []
    for groups in (1, 2, 4):
        rows = np.arange(groups * G)
        want_rows = expected(rows)
        calls.append(ahead.grad_ahead(packed(base, rows, T), full_only=True))
        assert calls[-1] == want_rows
        held += calls[-1]
    assert calls[0] < G and 0 < held < B, calls  # one group leaves micro-batches unfilled; so do all
    got = ahead.train_step(base)
    assert (got.grad_ahead_rows, got.grad_ahead_dropped) == (held, 0)
    for field in FIELDS:
        np.testing.assert_allclose(getattr(got, field), getattr(want, field), rtol=1e-4, atol=1e-6, err_msg=field)
    for a, b in zip(jax.tree.leaves(host(ahead.params)), jax.tree.leaves(host(plain.params))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=0.02 * CONFIG.lr)
