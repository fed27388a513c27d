"""Every attention implementation against the reference, forward and gradient (the TPU splash
kernel through the Pallas interpreter on CPU), and the decoder's choice of kernel."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dora_jax.models import ModelConfig, init_model
from dora_jax.models.attention import causal_attention, resolve_implementation
from dora_jax.parallel.sharding import TRAINER_RULES, make_mesh


def _qkv(B, T, H, K, D, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, D)), dtype) for n in (H, K, K))
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return q, k, v, positions


def _loss_and_grads(implementation, q, k, v, positions):
    weights = jnp.asarray(np.random.default_rng(9).normal(size=q.shape), jnp.float32)

    def loss(q, k, v):
        out = causal_attention(q, k, v, positions, implementation=implementation)
        return jnp.sum(weights * out.astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.parametrize(
    "implementation,shape",
    [
        ("xla", (2, 13, 4, 2, 16)),  # GQA, a length no block divides
        ("xla", (1, 8, 3, 3, 24)),  # MHA, an odd head_dim
        ("pallas_interpret", (2, 130, 4, 2, 16)),  # GQA, padded to 256 (two 128 blocks)
        ("pallas_interpret", (1, 20, 2, 1, 32)),  # MQA, padded to 128
    ],
)
def test_kernel_matches_reference_forward_and_gradient(implementation, shape):
    q, k, v, positions = _qkv(*shape)
    attend = jax.jit(causal_attention, static_argnames="implementation")
    want_out = attend(q, k, v, positions, implementation="reference")
    out = attend(q, k, v, positions, implementation=implementation)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=2e-6)
    (want_loss, want_grads), (got_loss, got_grads) = (
        _loss_and_grads(impl, q, k, v, positions) for impl in ("reference", implementation)
    )
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    for name, got, want in zip("qkv", got_grads, want_grads, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5, err_msg=name)


def test_kernel_on_a_mesh_runs_per_shard_and_matches_reference():
    """On 8 devices the kernel runs under shard_map: batch over data x fsdp, heads over tensor."""
    q, k, v, positions = _qkv(4, 20, 4, 2, 16, seed=7)
    want = causal_attention(q, k, v, positions, implementation="reference")
    attend = jax.jit(functools.partial(causal_attention, implementation="pallas_interpret"))
    with jax.set_mesh(_mesh()), nnx.logical_axis_rules(TRAINER_RULES):
        got = attend(q, k, v, positions)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)
    with jax.set_mesh(_mesh()), pytest.raises(ValueError, match="needs the logical axis rules in context"):
        causal_attention(q, k, v, positions, implementation="pallas_interpret")


def test_pallas_kernel_in_bf16_is_close_to_reference():
    q, k, v, positions = _qkv(1, 128, 2, 1, 32, dtype=jnp.bfloat16, seed=3)
    want = causal_attention(q, k, v, positions, implementation="reference")
    got = causal_attention(q, k, v, positions, implementation="pallas_interpret")
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=3e-2)


def _mesh():
    return make_mesh(jax.devices()[:8], {"data": 2, "fsdp": 2, "tensor": 2})


def test_auto_picks_by_backend():
    assert resolve_implementation("auto", jnp.float32, "cpu") == "reference"
    # 8 devices: the kernel only where it can be placed (a mesh and logical rules in context)
    assert resolve_implementation("auto", jnp.bfloat16, "tpu") == "reference"
    with jax.set_mesh(_mesh()), nnx.logical_axis_rules(TRAINER_RULES):
        assert resolve_implementation("auto", jnp.bfloat16, "tpu") == "pallas_tpu"
    assert resolve_implementation("auto", jnp.bfloat16, "gpu") == "cudnn"
    assert resolve_implementation("auto", jnp.float32, "gpu") == "xla"
    assert resolve_implementation("xla", jnp.float32, "tpu") == "xla"
    with pytest.raises(ValueError, match=r"attention='flash'; expected one of"):
        resolve_implementation("flash", jnp.float32)
    with pytest.raises(ValueError, match=r"attention='flash'; expected one of"):
        ModelConfig(attention="flash")


@pytest.mark.slow  # ~18 s: the interpreted kernel inside a whole decoder
def test_decoder_logits_are_the_same_through_the_tpu_kernel():
    """The full forward with the splash kernel (interpreted) equals the reference; the cached path
    is untouched by the choice."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 11)), jnp.int32)
    forward = jax.jit(lambda model, tokens: model(tokens))
    want = forward(init_model(cfg, seed=5), tokens)
    got = forward(init_model(cfg.replace(attention="pallas_interpret"), seed=5), tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
