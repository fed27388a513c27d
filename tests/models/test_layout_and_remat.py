"""Activation layouts (logical constraints under a mesh and rule table), rematerialisation and the
scanned layer loop: none changes a number; the constraints split every activation's rows over the
batch axes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dora_jax.models import ModelConfig, init_model, split
from dora_jax.parallel import sharding

CFG = ModelConfig(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
)
TOKENS = np.random.default_rng(0).integers(0, 96, (8, 12)).astype(np.int32)


def _loss_and_grads(cfg, mesh=None, rules=sharding.TRAINER_RULES):
    graphdef, params = split(init_model(cfg, seed=0))

    def loss(p, tokens):
        logits = nnx.merge(graphdef, p)(tokens)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0] ** 2)

    fn = jax.jit(jax.value_and_grad(loss))
    if mesh is None:
        return fn(params, TOKENS)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        return fn(params, TOKENS)


@pytest.mark.parametrize("policy", ["dots", "full"])
def test_remat_changes_no_number(policy):
    loss0, grads0 = _loss_and_grads(CFG)
    loss1, grads1 = _loss_and_grads(CFG.replace(remat=policy))
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    # The recomputed forward is fused, so summed, in another order: an element summed from terms
    # that cancel carries the rounding of the terms, not its own. Each leaf's elements agree within
    # 1e-5 of themselves or 1e-6 of the leaf's largest (8 fp32 ulps there); absolute 1e-7 was
    # exceeded by one element of 6,144 on this CI machine's CPU (0.0039167 vs 0.0039169).
    for a, b in zip(jax.tree.leaves(grads1), jax.tree.leaves(grads0)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(np.abs(b).max()))


def _count(jaxpr, primitive: str) -> int:
    """Equations of `primitive` in a jaxpr and every sub-jaxpr (remat, pjit, custom_vjp bodies)."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == primitive
        for param in eqn.params.values():
            for sub in param if isinstance(param, list | tuple) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    n += _count(inner, primitive)
    return n


def test_remat_recomputes_in_the_backward_pass():
    """The gradient recomputes matmuls the policy does not keep: "dots" only the attention's
    batched ones (scores, probabilities x values), "full" every one. (Compiled for a v5e chip with
    libtpu, hidden 256, 4 layers, 8 x 512 tokens, the gradient's temporaries were 201 MB with
    "none", 108 MB with "dots" and 18 MB with "full".)"""

    def matmuls(remat):
        graphdef, params = split(init_model(CFG.replace(remat=remat), seed=0))
        grad = jax.grad(lambda p, t: nnx.merge(graphdef, p)(t).mean())
        return _count(jax.make_jaxpr(grad)(params, TOKENS).jaxpr, "dot_general")

    none, dots, full = matmuls("none"), matmuls("dots"), matmuls("full")
    assert none < dots < full, (none, dots, full)


def test_scanned_layers_change_no_number():
    """The blocks under one `lax.scan` (their params stacked, cast to the compute dtype) give the
    unrolled loop's loss, gradient and prefill cache; the jaxpr has one scan over the blocks."""
    cfg = CFG.replace(num_layers=3, remat="dots")  # the MoE test below runs the scan without remat
    loss0, grads0 = _loss_and_grads(cfg)
    loss1, grads1 = _loss_and_grads(cfg.replace(scan_layers=True))
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads1), jax.tree.leaves(grads0)):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    logits0, kv0 = init_model(cfg, seed=0)(TOKENS, return_kv=True)
    scanned = init_model(cfg.replace(scan_layers=True), seed=0)
    logits1, kv1 = scanned(TOKENS, return_kv=True)
    np.testing.assert_allclose(logits1, logits0, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kv1.k_LBSKD, kv0.k_LBSKD, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kv1.v_LBSKD, kv0.v_LBSKD, rtol=1e-5, atol=1e-6)
    graphdef, params = split(scanned)
    jaxpr = jax.make_jaxpr(lambda p: nnx.merge(graphdef, p)(TOKENS))(params).jaxpr
    assert _count(jaxpr, "scan") == 1
    unrolled = jax.make_jaxpr(lambda p: init_model(cfg, 0)(TOKENS))(params).jaxpr
    assert _count(jaxpr, "dot_general") < _count(unrolled, "dot_general")  # one block's, not three


def test_scanned_moe_layers_return_every_layers_routing():
    cfg = CFG.replace(
        model_type="qwen3_moe",
        qk_norm=True,
        attention_bias=False,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        num_layers=2,
    )
    _, routing0 = init_model(cfg, seed=0)(TOKENS, return_routing=True)
    logits1, routing1 = init_model(cfg.replace(scan_layers=True), seed=0)(TOKENS, return_routing=True)
    assert len(routing1) == len(routing0) == 2
    for a, b in zip(jax.tree.leaves(routing1), jax.tree.leaves(routing0)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="scan_layers=True needs blocks of one kind"):
        cfg.replace(scan_layers=True, mlp_only_layers=(0,))


def test_activations_are_split_over_the_batch_axes_and_numbers_match():
    mesh = sharding.make_mesh(jax.devices()[:8], {"data": 2, "fsdp": 2, "tensor": 2})
    loss0, grads0 = _loss_and_grads(CFG)
    for cfg in (CFG, CFG.replace(scan_layers=True)):
        loss8, grads8 = _loss_and_grads(cfg, mesh)
        np.testing.assert_allclose(loss8, loss0, rtol=1e-5)
        for a, b in zip(jax.tree.leaves(grads8), jax.tree.leaves(grads0)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    graphdef, params = split(init_model(CFG, seed=0))
    forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t, return_hidden=True))
    with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.TRAINER_RULES):
        hidden = forward(params, TOKENS)
        hlo = forward.lower(params, TOKENS).as_text()
    assert hidden.sharding.spec[0] == ("data", "fsdp")  # 8 rows: 2 per (data, fsdp) shard
    assert hidden.sharding.shard_shape(hidden.shape)[0] == 2
    assert "sharding" in hlo and "mhlo.sharding" in hlo or "sdy.sharding" in hlo


def test_no_mesh_in_context_leaves_the_single_device_path_alone():
    x = jnp.ones((4, 3, 8))
    assert sharding.constrain(x, ("batch", "length", "embed")) is x
