"""The Trainer on 8 fake CPU devices: sharded == single device, no recompiles, per-version recompute, NaN skips."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from dora_jax.core.records import TrainBatch
from dora_jax.models import ModelConfig, init_model, logical_axes, split
from dora_jax.parallel import sharding
from dora_jax.store import InProcessTier, ParamStore
from dora_jax.trainer import Trainer, TrainerConfig
from dora_jax.trainer.step import sequence_logps

# Tests compile at XLA's lowest backend optimisation level: 3x faster compiles, same numbers to
# fp32 tolerance (the trainer's default is XLA's default).
FAST_COMPILE = {"xla_backend_optimization_level": 0}
CFG = ModelConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
)
B, T, G = 16, 32, 4
# Every optional feature on, so the sharded == single-device check covers them all.
CONFIG = TrainerConfig(
    lr=3e-3,
    schedule="cosine",
    warmup_steps=0,
    decay_steps=100,
    clip_grad_norm=1.0,
    tis_cap=2.0,
    kl_coef=0.01,
    loss_norm="seq_mean_token_mean",
    dynamic_sampling=True,
    num_updates=2,
    micro_batch_size=4,
    max_nonfinite_in_a_row=3,
)


def make_batch(seed: int, versions) -> TrainBatch:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(12, T + 1, B)
    tokens = rng.integers(1, CFG.vocab_size, (B, T)).astype(np.int32)
    loss_mask = np.zeros((B, T), np.float32)
    for b, n in enumerate(lengths):
        tokens[b, n:] = 0
        loss_mask[b, 6:n] = 1
    rewards = np.tile(np.float32([1, 0, 0, 1]), B // G)
    rewards[:G] = 1.0  # group 0 has zero variance: dynamic sampling drops it
    valid = np.ones(B, np.float32)
    valid[5] = 0.0
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


def host(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.fixture(scope="module")
def model():
    model = init_model(CFG, seed=0)
    graphdef, params = split(model)
    return graphdef, params, logical_axes(model)


@pytest.fixture(scope="module")
def first_step(model):
    """One step of the same batch on fsdp=4 x tensor=2 and on a single device."""
    graphdef, params, axes = model
    mesh8 = sharding.make_mesh(jax.devices(), {"fsdp": 4, "tensor": 2})
    mesh1 = sharding.make_mesh(jax.devices()[:1], {})
    store = ParamStore(InProcessTier())
    sharded = Trainer(graphdef, params, axes, mesh8, CONFIG, store, compiler_options=FAST_COMPILE)
    single = Trainer(graphdef, params, axes, mesh1, CONFIG, compiler_options=FAST_COMPILE)
    assert sharded.params["layers"][0]["attn"]["q_EHD"].sharding.spec == P("fsdp", "tensor", None)
    sharded.publish()
    batch = make_batch(0, 0)
    metrics8, metrics1 = sharded.train_step(batch), single.train_step(batch)
    return dict(
        sharded=sharded,
        single=single,
        store=store,
        params8=host(sharded.params),
        params1=host(single.params),
        metrics8=metrics8,
        metrics1=metrics1,
        params0=host(params),
    )


def test_sharded_step_equals_single_device(first_step):
    m8, m1 = first_step["metrics8"], first_step["metrics1"]
    assert m8.version == m1.version == 1 and m8.skipped_updates == 0
    assert m8.dropped_groups == 1 and m8.staleness == {0: B}
    # cosine from lr at update 0 over 100 updates: the step's last update is update 1
    np.testing.assert_allclose(m8.lr, CONFIG.lr * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 1 / 100))), rtol=1e-6)
    for field in ("loss", "grad_norm", "ratio_mean", "ratio_max", "tis_mean", "entropy", "kl", "clip_frac_high"):
        np.testing.assert_allclose(getattr(m8, field), getattr(m1, field), rtol=1e-4, atol=1e-6, err_msg=field)
    assert m8.ratio_max > 1.0  # the second update saw the first one's change
    moved = 0.0
    for a, b, p0 in zip(
        jax.tree.leaves(first_step["params8"]),
        jax.tree.leaves(first_step["params1"]),
        jax.tree.leaves(first_step["params0"]),
    ):
        # Adam divides by sqrt(v): in a coordinate whose gradient is near zero, fp32
        # reduction-order noise moves the update by up to ~1% of the step size (lr = 3e-3); a
        # sharding bug moves whole tensors by O(lr), so bound the max by 2% of lr and the mean tightly.
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=0.02 * CONFIG.lr)
        assert np.abs(a - b).mean() < 1e-7
        moved = max(moved, float(np.abs(a - p0).max()))
    assert moved > 1e-3  # the update really changed the params


@pytest.fixture(scope="module")
def later_steps(first_step):
    """Two more steps on the sharded trainer with batches mixing versions; each version published."""
    trainer = first_step["sharded"]
    trainer.publish()
    m2 = trainer.train_step(make_batch(1, np.arange(B) % 2))  # versions 0 and 1
    trainer.publish()
    m3 = trainer.train_step(make_batch(2, np.arange(B) % 3))  # versions 0, 1, 2
    trainer.publish()
    return m2, m3


def test_no_recompiles_across_steps(first_step, later_steps):
    m2, m3 = later_steps
    assert first_step["sharded"].trace_counts == {"train_step": 1, "recompute": 1}
    assert m2.staleness == {0: 8, 1: 8} and m3.staleness == {0: 5, 1: 5, 2: 6}
    assert m3.version == 3 and m3.tokens_per_s > 0


def test_recompute_uses_each_samples_own_version(model, first_step, later_steps):
    graphdef, _, _ = model
    trainer, store = first_step["sharded"], first_step["store"]
    assert store.versions() == (0, 1, 2, 3)
    versions = np.array([3, 0, 2, 1] * 4)
    batch = make_batch(7, versions)
    got = trainer.behaviour_logps(batch)
    mesh1 = sharding.make_mesh(jax.devices()[:1], {})
    forward = jax.jit(lambda p, t: sequence_logps(graphdef, p, t)[0], compiler_options=FAST_COMPILE)
    per_version = {}
    for v in range(4):
        params_v = store.get(v, jax.tree.map(lambda _: sharding.replicated(mesh1), trainer.param_shardings))
        per_version[v] = np.asarray(forward(params_v, batch.tokens_BT))
    for b, v in enumerate(versions):
        np.testing.assert_allclose(got[b], per_version[v][b], rtol=1e-5, atol=1e-5)
    # The versions really differ, so a wrong version would have been caught.
    assert np.abs(per_version[0] - per_version[3]).max() > 1e-3
    assert trainer.trace_counts["recompute"] == 1


def test_load_state_restores_params_and_version(first_step):
    trainer = first_step["single"]
    saved, version = host(trainer.state), trainer.version
    trainer.train_step(make_batch(20, version))
    assert trainer.version == version + 1 and int(trainer.state.updates) == int(saved.updates) + 2
    trainer.load_state(saved, version)
    assert trainer.version == version
    for a, b in zip(jax.tree.leaves(host(trainer.state)), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(a, b)
    assert trainer.state.params["embed_VE"].sharding == trainer.param_shardings["embed_VE"]


def test_nonfinite_updates_are_skipped_then_raise(first_step):
    trainer = first_step["single"]

    def poisoned(seed):
        batch = make_batch(seed, trainer.version)
        batch.inference_logps_BT[[6, 13], 8] = np.nan  # a loss token in each update: NaN TIS weight
        return batch

    before = host(trainer.state)
    metrics = trainer.train_step(poisoned(10))
    assert metrics.skipped_updates == 2 and metrics.nonfinite_in_a_row == 2 and np.isnan(metrics.loss)
    assert int(trainer.state.updates) == int(before.updates)
    for a, b in zip(jax.tree.leaves(host(trainer.state)), jax.tree.leaves(before)):
        np.testing.assert_array_equal(a, b)  # params, optimizer state and update count untouched
    assert trainer.train_step(make_batch(11, trainer.version)).nonfinite_in_a_row == 0
    assert trainer.train_step(poisoned(12)).nonfinite_in_a_row == 2
    with pytest.raises(FloatingPointError, match=r"4 optimizer updates in a row had a non-finite loss"):
        trainer.train_step(poisoned(13))
    assert trainer.trace_counts["train_step"] == 1


def test_bad_batches_are_refused(first_step):
    trainer = first_step["single"]
    short = dataclasses.replace(make_batch(0, trainer.version), tokens_BT=np.zeros((12, T), np.int32))
    with pytest.raises(
        ValueError, match=r"batch of 12 samples does not split into trainer.num_updates=2 x trainer.micro_batch_size=4"
    ):
        trainer.train_step(short)
    with pytest.raises(ValueError, match=r"newer than the trainer's version"):
        trainer.train_step(make_batch(0, trainer.version + 1))
    with pytest.raises(ValueError, match=r"has no ParamStore"):
        trainer.train_step(make_batch(0, trainer.version - 1))
    with pytest.raises(ValueError, match=r"trainer.advantage='ppo'"):
        TrainerConfig(advantage="ppo")


def test_versions_are_published_and_served_in_the_compute_dtype():
    """fp32 master weights, bf16 compute: the store holds bf16 versions (half the bytes), the
    trainer's own current version is recomputed from the same bf16 values (its digest is the
    store's), no number changes (each block casts to bf16 before use), and an engine holds bf16."""
    from dora_jax.rollout.engine import EngineConfig, RolloutEngine
    from dora_jax.store.digest import params_digest

    cfg = CFG.replace(num_layers=1, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    model = init_model(cfg, seed=0)
    graphdef, params = split(model)
    mesh1 = sharding.make_mesh(jax.devices()[:1], {})
    store = ParamStore(InProcessTier())
    config = dataclasses.replace(CONFIG, num_updates=1, kl_coef=0.0)
    trainer = Trainer(graphdef, params, logical_axes(model), mesh1, config, store, compiler_options=FAST_COMPILE)
    assert trainer.serve_dtype == jnp.bfloat16
    trainer.publish()
    served = store.get(0, trainer.param_shardings)
    assert {x.dtype for x in jax.tree.leaves(served)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(trainer.params)} == {jnp.dtype(jnp.float32)}
    batch = make_batch(3, 0)
    forward = jax.jit(lambda p, t: sequence_logps(graphdef, p, t)[0], compiler_options=FAST_COMPILE)
    np.testing.assert_array_equal(forward(served, batch.tokens_BT), forward(params, batch.tokens_BT))
    metrics = trainer.train_step(batch)  # every row at the trainer's current version 0
    assert metrics.behaviour_digests == {0: params_digest(served)}
    engine = RolloutEngine(cfg, EngineConfig(num_slots=2, cache_length=32, max_prefill_length=16), mesh1)
    assert engine.model_config.param_dtype == jnp.bfloat16
    assert {x.dtype for x in jax.tree.leaves(engine.load_params(params))} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize("length_bucket", [0, 8], ids=["whole_batch", "bucketed"])
def test_current_version_rows_take_their_behaviour_logps_from_the_step(model, length_bucket):
    """Rows generated by the trainer's current version, trained on by the first update, take their
    behaviour log-probs from the gradient forward itself (held constant): they are not recomputed,
    and the step equals the one that recomputes them (`trainer.reuse_current_logps`)."""
    graphdef, params, axes = model
    mesh = sharding.make_mesh(jax.devices()[:2], {"fsdp": 2})
    batch = make_batch(4, np.arange(B) % 2)  # versions 0 and 1; the trainer is at version 1
    results = {}
    for reuse in (True, False):
        config = dataclasses.replace(CONFIG, reuse_current_logps=reuse, length_bucket=length_bucket, kl_coef=0.0)
        store = ParamStore(InProcessTier())
        own = jax.tree.map(np.array, params)  # kl_coef 0: the trainer donates (deletes) what it is given
        trainer = Trainer(graphdef, own, axes, mesh, config, store, compiler_options=FAST_COMPILE)
        trainer.publish()
        trainer.train_step(make_batch(0, 0))
        trainer.publish()
        metrics = trainer.train_step(batch)
        results[reuse] = (metrics, host(trainer.params), trainer.trace_counts)
    (reused, params_r, _), (recomputed, params_c, _) = results[True], results[False]
    # Version 1 holds half the rows; the first of the two updates trains on half of those.
    first_update_current = int((batch.versions_B[: B // 2] == 1).sum())
    assert first_update_current == 4
    assert recomputed.recomputed_rows == B and reused.recomputed_rows == B - first_update_current
    assert reused.behaviour_digests.keys() == recomputed.behaviour_digests.keys() == {0, 1}
    for field in ("loss", "grad_norm", "ratio_mean", "ratio_min", "ratio_max", "clip_frac_high", "entropy"):
        np.testing.assert_allclose(getattr(reused, field), getattr(recomputed, field), rtol=1e-4, atol=1e-6)
    for a, b in zip(jax.tree.leaves(params_r), jax.tree.leaves(params_c)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=0.02 * CONFIG.lr)  # as the sharded check, same reason
        assert np.abs(a - b).mean() < 1e-7


def _reference_at(logits_BTV: np.ndarray, tokens_BT: np.ndarray, temperature: float):
    """float64 numpy (logps_BT, entropy_BT) of softmax(logits / T), aligned on the predicted token."""
    z = logits_BTV[:, :-1].astype(np.float64) / temperature
    z -= z.max(-1, keepdims=True)
    logsm = z - np.log(np.exp(z).sum(-1, keepdims=True))
    logps, entropy = np.zeros(tokens_BT.shape), np.zeros(tokens_BT.shape)
    logps[:, 1:] = np.take_along_axis(logsm, tokens_BT[:, 1:, None], -1)[..., 0]
    entropy[:, 1:] = -(np.exp(logsm) * logsm).sum(-1)
    return logps, entropy


@pytest.mark.parametrize(
    "length_bucket, reuse", [(0, False), (0, True), (8, False)], ids=["recompute", "own_forward", "bucketed"]
)
def test_every_log_prob_is_at_the_rollout_temperature(model, length_bucket, reuse):
    """At T = 0.7 (TrainerConfig.temperature): the behaviour recompute equals a numpy
    log_softmax(logits / T); the step's current-policy forward equals the recompute (ratio 1), its
    entropy is that of softmax(logits / T), its KL reference is at T too (k3 = 0 at the first update),
    and inference log-probs given as the numpy reference at T make every TIS weight 1. A trainer at
    T = 1 on the same batch misses all of these."""
    graphdef, params, axes = model
    temperature = 0.7
    batch = make_batch(5, 0)
    batch = dataclasses.replace(batch, valid_B=np.ones(B, np.float32), rewards_B=np.tile(np.float32([1, 0]), B // 2))
    logits = np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, batch.tokens_BT))
    want_logps, want_entropy = _reference_at(logits, batch.tokens_BT, temperature)
    on = batch.loss_mask_BT > 0
    batch = dataclasses.replace(batch, inference_logps_BT=np.where(on, want_logps, 0.0).astype(np.float32))
    mesh1 = sharding.make_mesh(jax.devices()[:1], {})
    config = dataclasses.replace(
        CONFIG, num_updates=1, temperature=temperature, length_bucket=length_bucket, reuse_current_logps=reuse
    )
    trainer = Trainer(graphdef, params, axes, mesh1, config, compiler_options=FAST_COMPILE)
    np.testing.assert_allclose(trainer.behaviour_logps(batch)[on], want_logps[on], atol=2e-5, rtol=0)
    metrics = trainer.train_step(batch)
    assert metrics.recomputed_rows == (0 if reuse else B)
    for field in ("ratio_min", "ratio_max", "tis_mean", "tis_max"):
        np.testing.assert_allclose(getattr(metrics, field), 1.0, atol=5e-5, err_msg=field)
    np.testing.assert_allclose(metrics.entropy, want_entropy[on].mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics.kl, 0.0, atol=1e-6)
    if length_bucket == 0 and not reuse:  # the control: temperature-1 log-probs are another distribution
        plain = Trainer(graphdef, params, axes, mesh1, dataclasses.replace(config, temperature=1.0))
        assert np.abs(plain.behaviour_logps(batch)[on] - want_logps[on]).mean() > 0.01  # vs 2e-5 above
        control = plain.train_step(batch)
        assert abs(control.tis_mean - 1.0) > 0.01 and abs(control.entropy - want_entropy[on].mean()) > 5e-3


@pytest.mark.parametrize("length_bucket", [0, 8], ids=["whole_batch", "bucketed"])
def test_rows_scored_ahead_are_used_and_the_step_is_unchanged(model, length_bucket):
    """trainer.score_ahead: behaviour log-probs the trainer computed while it waited, for rows
    packed in a wider batch of their own (as a peek at the coordinator packs them), are used by the
    step, which recomputes only the other rows and equals the all-recompute step. A row stored
    under the same id with other tokens is recomputed; rows already stored are not computed again."""
    graphdef, params, axes = model
    mesh = sharding.make_mesh(jax.devices()[:2], {"fsdp": 2})
    base = make_batch(4, np.arange(B) % 2)  # versions 0 and 1; the trainer is at version 1
    half = B // 2
    peek = make_batch(4, np.arange(B) % 2)  # rows 0..half: the groups that finished first
    wide = lambda x, fill=0: np.pad(x, ((0, 0), (0, T)), constant_values=fill)  # noqa: E731
    tokens = wide(peek.tokens_BT)
    tokens[half, 7] = (tokens[half, 7] + 1) % CFG.vocab_size  # row `half`: same id, other tokens
    peek = dataclasses.replace(
        peek,
        tokens_BT=tokens,
        loss_mask_BT=wide(peek.loss_mask_BT),
        inference_logps_BT=wide(peek.inference_logps_BT),
        traj_ids=peek.traj_ids[: half + 1] + ("",) * (B - half - 1),
    )

    def run(ahead: bool):
        config = dataclasses.replace(
            CONFIG, length_bucket=length_bucket, kl_coef=0.0, reuse_current_logps=False, score_ahead=ahead
        )
        own = jax.tree.map(np.array, params)  # kl_coef 0: the trainer donates (deletes) what it is given
        trainer = Trainer(graphdef, own, axes, mesh, config, ParamStore(InProcessTier()), compiler_options=FAST_COMPILE)
        trainer.publish()
        trainer.train_step(make_batch(0, 0))
        trainer.publish()
        if ahead:
            assert trainer.score_ahead(peek) == half + 1 and trainer.score_ahead(peek) == 0
        return trainer.train_step(base), host(trainer.params)

    plain, params_p = run(False)
    ahead, params_a = run(True)
    assert (plain.recomputed_rows, plain.ahead_rows) == (B, 0)
    assert (ahead.recomputed_rows, ahead.ahead_rows) == (B - half, half)
    assert ahead.behaviour_digests == plain.behaviour_digests  # versions 0 and 1, the same params
    for field in ("loss", "grad_norm", "ratio_mean", "ratio_min", "ratio_max", "clip_frac_high"):
        np.testing.assert_allclose(getattr(ahead, field), getattr(plain, field), rtol=1e-4, atol=1e-6)
    for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_p)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=0.02 * CONFIG.lr)


def test_current_rows_scored_ahead_leave_the_step_its_own_forward(model):
    """With `reuse_current_logps`, score_ahead computes the current version's rows too (most are
    trained after the params move), yet the rows a step trains before the params move (its first
    update) take its own forward's: only the others use what was computed ahead (none recomputed),
    and the step equals the one without score_ahead."""
    graphdef, params, axes = model
    mesh = sharding.make_mesh(jax.devices()[:2], {"fsdp": 2})
    base = make_batch(4, np.arange(B) % 2)  # versions 0 and 1; the trainer is at version 1

    def run(ahead: bool):
        config = dataclasses.replace(CONFIG, kl_coef=0.0, reuse_current_logps=True, score_ahead=ahead)
        own = jax.tree.map(np.array, params)
        trainer = Trainer(graphdef, own, axes, mesh, config, ParamStore(InProcessTier()), compiler_options=FAST_COMPILE)
        trainer.publish()
        trainer.train_step(make_batch(0, 0))
        trainer.publish()
        if ahead:
            assert trainer.score_ahead(base) == B  # both versions' rows
        return trainer.train_step(base)

    plain, ahead = run(False), run(True)
    own = int(((np.arange(B) % 2 == 1) & (np.arange(B) < B // CONFIG.num_updates)).sum())  # current, 1st update
    assert 0 < own < B // 2
    assert (plain.recomputed_rows, plain.ahead_rows) == (B - own, 0)
    assert (ahead.recomputed_rows, ahead.ahead_rows) == (0, B - own)
    assert ahead.behaviour_digests == plain.behaviour_digests
    for field in ("loss", "grad_norm", "ratio_mean", "ratio_min", "ratio_max"):
        np.testing.assert_allclose(getattr(ahead, field), getattr(plain, field), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("length_bucket", [0, 8], ids=["whole_batch", "bucketed"])
def test_rollout_scored_behaviour_logps_are_used_and_the_rest_recomputed(model, length_bucket):
    """trainer.behaviour_logps = "rollout": rows that arrive with behaviour log-probs use them and
    are not recomputed; the others (arrived without) are, each with its own version. Given exactly
    the log-probs the trainer would compute, the step equals the all-recompute one; given other
    ones, the step's ratios move (they are used). Under "trainer" arriving ones are ignored."""
    graphdef, params, axes = model
    mesh = sharding.make_mesh(jax.devices()[:2], {"fsdp": 2})
    base = make_batch(4, np.arange(B) % 2)  # versions 0 and 1; the trainer is at version 1
    known_B = np.arange(B) % 4 < 2  # half the rows arrive scored, of both versions
    on = base.loss_mask_BT > 0

    def run(source: str, shift: float):
        config = dataclasses.replace(
            CONFIG, behaviour_logps=source, length_bucket=length_bucket, kl_coef=0.0, reuse_current_logps=False
        )
        own = jax.tree.map(np.array, params)  # kl_coef 0: the trainer donates (deletes) what it is given
        trainer = Trainer(graphdef, own, axes, mesh, config, ParamStore(InProcessTier()), compiler_options=FAST_COMPILE)
        trainer.publish()
        trainer.train_step(make_batch(0, 0))
        trainer.publish()
        exact_BT = trainer.behaviour_logps(base)
        arrived_BT = np.where(on & known_B[:, None], exact_BT + shift, 0.0).astype(np.float32)
        batch = dataclasses.replace(base, behaviour_logps_BT=arrived_BT, behaviour_known_B=known_B)
        return trainer.train_step(batch), host(trainer.params)

    recomputed, params_t = run("trainer", -0.5)  # the arriving (wrong) log-probs are ignored
    scored, params_s = run("rollout", 0.0)
    shifted, _ = run("rollout", -0.5)
    assert recomputed.recomputed_rows == B and recomputed.rollout_scored_rows == 0
    assert scored.recomputed_rows == shifted.recomputed_rows == B - known_B.sum() == B // 2
    assert scored.rollout_scored_rows == B // 2
    for field in ("loss", "grad_norm", "ratio_mean", "ratio_min", "ratio_max", "clip_frac_high"):
        np.testing.assert_allclose(getattr(scored, field), getattr(recomputed, field), rtol=1e-4, atol=1e-6)
    for a, b in zip(jax.tree.leaves(params_s), jax.tree.leaves(params_t)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=0.02 * CONFIG.lr)
    # Behaviour log-probs 0.5 lower on half the rows: their ratios grow by exp(0.5) = 1.65.
    assert shifted.ratio_max > 1.4 * recomputed.ratio_max and shifted.ratio_mean > 1.2 * recomputed.ratio_mean


@pytest.mark.parametrize("length_bucket", [0, 8], ids=["whole_batch", "bucketed"])
def test_sampler_behaviour_logps_are_the_inference_logps_and_nothing_is_recomputed(model, length_bucket):
    """trainer.behaviour_logps = "sampler": every row's behaviour log-probs are its own inference
    (sampling) log-probs, current-version rows included, so the step recomputes none and needs no
    params of older versions. Where those equal the trainer's recompute (as the engine's do in
    fp32: tests/rollout/test_rollout_scoring.py) the step equals the recomputing one, params and
    all; lowered by 0.5, the ratios grow by exp(0.5) (they are used) and the TIS weight stays 1."""
    graphdef, params, axes = model
    mesh = sharding.make_mesh(jax.devices()[:2], {"fsdp": 2})
    base = make_batch(4, np.arange(B) % 2)  # versions 0 and 1; the trainer is at version 1

    def run(source: str, shift: float):
        config = dataclasses.replace(CONFIG, behaviour_logps=source, length_bucket=length_bucket, kl_coef=0.0)
        own = jax.tree.map(np.array, params)  # kl_coef 0: the trainer donates (deletes) what it is given
        trainer = Trainer(graphdef, own, axes, mesh, config, ParamStore(InProcessTier()), compiler_options=FAST_COMPILE)

        def sampled(batch, shift=0.0):  # the batch with inference log-probs of the trainer's own
            exact_BT = trainer.behaviour_logps(batch)
            logps_BT = np.where(batch.loss_mask_BT > 0, exact_BT + shift, 0.0).astype(np.float32)
            return dataclasses.replace(batch, inference_logps_BT=logps_BT)

        trainer.publish()
        trainer.train_step(sampled(make_batch(0, 0)))  # both sources start the second step from the same params
        trainer.publish()
        return trainer.train_step(sampled(base, shift)), host(trainer.params)

    recomputed, params_t = run("trainer", 0.0)
    sampled, params_s = run("sampler", 0.0)
    shifted, _ = run("sampler", -0.5)
    own = int(((np.arange(B) % 2 == 1) & (np.arange(B) < B // CONFIG.num_updates)).sum())  # current, 1st update
    assert (recomputed.recomputed_rows, recomputed.sampler_rows) == (B - own, 0)
    assert (sampled.recomputed_rows, sampled.rollout_scored_rows, sampled.ahead_rows, sampled.sampler_rows) == (
        0,
        0,
        0,
        B,
    )
    assert sampled.behaviour_digests == {} and set(recomputed.behaviour_digests) == {0, 1}
    for field in ("loss", "grad_norm", "ratio_mean", "ratio_min", "ratio_max", "clip_frac_high", "tis_mean"):
        np.testing.assert_allclose(getattr(sampled, field), getattr(recomputed, field), rtol=1e-4, atol=1e-6)
    for a, b in zip(jax.tree.leaves(params_s), jax.tree.leaves(params_t)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=0.02 * CONFIG.lr)
    assert shifted.ratio_max > 1.4 * recomputed.ratio_max and shifted.ratio_mean > 1.2 * recomputed.ratio_mean
    assert shifted.tis_mean == shifted.tis_max == 1.0


def test_sampler_behaviour_logps_refuse_score_ahead():
    """Nothing is left to score ahead when every row arrives with its behaviour log-probs: the
    config is refused, naming both fields."""
    with pytest.raises(ValueError, match=r"trainer.score_ahead=True with trainer.behaviour_logps=\"sampler\""):
        dataclasses.replace(CONFIG, behaviour_logps="sampler", score_ahead=True)
