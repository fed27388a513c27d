"""The pure train step: accumulating micro-batch gradients equals one full mini-batch."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dora_jax.models import ModelConfig, init_model, split
from dora_jax.trainer.loss import LossConfig
from dora_jax.trainer.step import StepInputs, init_state, train_step

CFG = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16
)
FAST_COMPILE = {"xla_backend_optimization_level": 0}
B, T = 8, 16


@pytest.mark.slow
def test_micro_batches_add_up_to_the_mini_batch():
    graphdef, params = split(init_model(CFG, seed=2))
    tx = optax.sgd(1.0)  # params - new params = the gradient itself: compare gradients, not Adam's signs
    rng = np.random.default_rng(0)
    lengths = rng.integers(6, T + 1, B)
    mask = (np.arange(T)[None] >= 3) & (np.arange(T)[None] < lengths[:, None])
    flat = dict(
        tokens=rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32),
        mask=mask.astype(np.float32),
        inference=np.full((B, T), -4.0, np.float32),
        behaviour=rng.normal(-4.2, 0.2, (B, T)).astype(np.float32),
    )
    rewards_B = jnp.asarray(rng.permutation(np.arange(B) % 2), jnp.float32)
    valid_B = jnp.ones(B).at[3].set(0.0)
    results = []
    for M in (1, 4):  # one micro-batch of 8 rows, or four of 2
        inputs = StepInputs(
            *[jnp.asarray(flat[k].reshape(1, M, B // M, T)) for k in ("tokens", "mask", "inference", "behaviour")],
            rewards_B=rewards_B,
            valid_B=valid_B,
            group_ids_B=jnp.arange(B) // 4,
        )
        step = jax.jit(
            functools.partial(
                train_step,
                graphdef=graphdef,
                tx=tx,
                estimator="grpo",
                dynamic_sampling=False,
                loss_config=LossConfig(loss_norm="seq_mean_token_mean", tis_cap=1.2),
            ),
            compiler_options=FAST_COMPILE,
        )
        state, out = step(init_state(params, tx), inputs, None)
        results.append((jax.device_get(state.params), jax.device_get(out)))
    (p1, o1), (p4, o4) = results
    np.testing.assert_allclose(o1.loss, o4.loss, rtol=1e-5)
    np.testing.assert_allclose(o1.grad_norm, o4.grad_norm, rtol=1e-5)
    assert float(o1.stats.tokens) == float(o4.stats.tokens) == float((mask.sum(1) * (np.arange(B) != 3)).sum())
    for a, b, p0 in zip(jax.tree.leaves(p1), jax.tree.leaves(p4), jax.tree.leaves(params)):
        g1, g4 = np.asarray(p0) - a, np.asarray(p0) - b
        np.testing.assert_allclose(g1, g4, rtol=1e-4, atol=1e-4 * np.abs(g1).max())
