"""A Qwen3-MoE model in the Trainer: experts sharded over the `expert` mesh axis == one device,
router metrics equal to the routing of the batch, the optional load-balancing loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dora_jax.models import ModelConfig, expert_load, init_model, load_balancing_loss, logical_axes, split
from dora_jax.parallel import sharding
from dora_jax.trainer import Trainer, TrainerConfig
from tests.trainer.test_trainer import FAST_COMPILE, B, make_batch

pytestmark = pytest.mark.slow  # every test here compiles MoE train steps (about 2 minutes together)

MOE = ModelConfig(
    model_type="qwen3_moe",
    qk_norm=True,
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
)
CONFIG = TrainerConfig(
    lr=3e-3, clip_grad_norm=1.0, tis_cap=2.0, num_updates=1, micro_batch_size=4, router_aux_coef=0.01
)


def _model(dispatch: str):
    model = init_model(MOE.replace(moe_dispatch=dispatch), seed=0)
    graphdef, params = split(model)
    # A router with clear preferences (std 0.02 routes almost uniformly), so that load is skewed.
    key = jax.random.key(1)
    for layer in params["layers"].values():
        key, sub = jax.random.split(key)
        layer["mlp"]["router_EX"] = 0.5 * jax.random.normal(sub, layer["mlp"]["router_EX"].shape)
    return graphdef, params, logical_axes(model)


def _host(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.fixture(scope="module", params=["dense", "grouped"])
def steps(request):
    graphdef, params, axes = _model(request.param)
    params0 = _host(params)
    mesh8 = sharding.make_mesh(jax.devices(), {"fsdp": 2, "expert": 4})
    mesh1 = sharding.make_mesh(jax.devices()[:1], {})
    sharded = Trainer(graphdef, params, axes, mesh8, CONFIG, compiler_options=FAST_COMPILE)
    single = Trainer(graphdef, params, axes, mesh1, CONFIG, compiler_options=FAST_COMPILE)
    assert sharded.params["layers"][0]["mlp"]["gate_XEM"].sharding.spec == P("expert", "fsdp", None)
    batch = make_batch(0, 0)
    return dict(
        graphdef=graphdef,
        params0=params0,
        batch=batch,
        m8=sharded.train_step(batch),
        m1=single.train_step(batch),
        p8=_host(sharded.params),
        p1=_host(single.params),
    )


def test_expert_sharded_step_equals_single_device(steps):
    m8, m1 = steps["m8"], steps["m1"]
    for field in ("loss", "grad_norm", "ratio_mean", "entropy", "router_aux_loss"):
        np.testing.assert_allclose(getattr(m8, field), getattr(m1, field), rtol=1e-4, atol=1e-6, err_msg=field)
    assert m8.expert_load == m1.expert_load
    moved = 0.0
    for a, b, p0 in zip(jax.tree.leaves(steps["p8"]), jax.tree.leaves(steps["p1"]), jax.tree.leaves(steps["params0"])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=0.02 * CONFIG.lr)  # see tests/trainer/test_trainer.py
        assert np.abs(a - b).mean() < 1e-7
        moved = max(moved, float(np.abs(a - p0).max()))
    assert moved > 1e-3


def test_router_metrics_are_the_batch_routing(steps):
    """The step's expert load and aux loss equal the routing of the batch's loss tokens under the
    params the step started from (one update: the forward saw exactly those params)."""
    from flax import nnx

    batch, m = steps["batch"], steps["m8"]
    mask = jnp.asarray(batch.loss_mask_BT * batch.valid_B[:, None])
    model = nnx.merge(steps["graphdef"], jax.tree.map(jnp.asarray, steps["params0"]))
    _, routing = model(jnp.asarray(batch.tokens_BT), return_routing=True)
    expected = [tuple(int(n) for n in np.asarray(expert_load(r, mask))) for r in routing]
    assert m.expert_load == tuple(expected)
    assert all(sum(load) == 2 * int(mask.sum()) for load in m.expert_load)  # K per loss token
    # Micro-batches of 4 rows: the aux loss is the mean of the 4 micro-batches' losses.
    micro = [
        float(
            load_balancing_loss(
                tuple(jax.tree.map(lambda x, i=i: x[4 * i : 4 * i + 4], r) for r in routing), mask[4 * i : 4 * i + 4]
            )
        )
        for i in range(B // 4)
    ]
    np.testing.assert_allclose(m.router_aux_loss, np.mean(micro), rtol=1e-5)
    ratios = [max(load) / np.mean(load) for load in m.expert_load]
    np.testing.assert_allclose(m.router_load_ratio, ratios, rtol=1e-6)
    assert max(ratios) > 1.2  # the skewed router really is unbalanced
    row = m.as_dict()
    assert row["router/load_ratio_max"] == max(ratios) and row["router/expert_load/1"] == list(m.expert_load[1])


def test_aux_loss_enters_the_objective_only_when_asked():
    graphdef, params, axes = _model("dense")
    mesh1 = sharding.make_mesh(jax.devices()[:1], {})
    batch = make_batch(0, 0)
    off = Trainer(
        graphdef, params, axes, mesh1, TrainerConfig(lr=3e-3, micro_batch_size=4), compiler_options=FAST_COMPILE
    ).train_step(batch)
    on = Trainer(
        graphdef,
        params,
        axes,
        mesh1,
        TrainerConfig(lr=3e-3, micro_batch_size=4, router_aux_coef=0.5),
        compiler_options=FAST_COMPILE,
    ).train_step(batch)
    np.testing.assert_allclose(on.router_aux_loss, off.router_aux_loss, rtol=1e-6)  # measured either way
    np.testing.assert_allclose(on.loss - off.loss, 0.5 * on.router_aux_loss, rtol=1e-4)
    assert on.grad_norm != off.grad_norm


def test_dense_model_reports_no_router_metrics():
    cfg = ModelConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16
    )
    model = init_model(cfg)
    graphdef, params = split(model)
    mesh1 = sharding.make_mesh(jax.devices()[:1], {})
    m = Trainer(
        graphdef, params, logical_axes(model), mesh1, TrainerConfig(micro_batch_size=4), compiler_options=FAST_COMPILE
    ).train_step(make_batch(0, 0))
    assert m.expert_load is None and m.router_aux_loss is None
    assert not any(k.startswith("router/") for k in m.as_dict())
