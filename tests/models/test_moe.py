"""Qwen3-MoE: our sparse MoE decoder against HF transformers on tiny random checkpoints; the dense
and grouped computations against each other; the fused expert layout; router statistics."""

from __future__ import annotations

import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

from dora_jax.models import (
    KVCache,
    ModelConfig,
    expert_load,
    init_model,
    load_balancing_loss,
    load_hf,
    logical_axes,
    read_config,
    save_hf,
    split,
)
from dora_jax.models.moe import dense_experts, grouped_experts, route
from dora_jax.parallel import sharding
from tests.models.hf_fixtures import VOCAB, hf_logits

EXPERTS, TOP_K = 8, 2


def moe_config(**overrides):
    """hidden 64, 8 experts, top-2, 2 layers; non-default options so that their maths is checked."""
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=2,
    )
    fields.update(overrides)
    return transformers.Qwen3MoeConfig(**fields)


def make_moe_checkpoint(path, seed: int = 0, **overrides):
    """A random Qwen3-MoE saved with save_pretrained (per-expert tensors); the torch model (fp32)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(moe_config(**overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):  # a router with clear preferences (std 0.02 is near-uniform)
                p.normal_(0.0, 0.5)
    model.eval()
    model.save_pretrained(str(path))
    return model


def _rel_err(ours, ref):
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    return str(path), make_moe_checkpoint(path)


IDS = np.random.default_rng(0).integers(0, VOCAB, size=(2, 24))


@pytest.mark.parametrize("dispatch", ["dense", "grouped"])
def test_logits_match_transformers(checkpoint, dispatch):
    path, torch_model = checkpoint
    model = load_hf(path, dtype=jnp.float32, moe_dispatch=dispatch)
    ours = np.asarray(model(jnp.asarray(IDS, jnp.int32)))
    ref = hf_logits(torch_model, IDS)
    assert ours.shape == ref.shape == (2, 24, VOCAB)
    assert _rel_err(ours, ref) < 1e-3


def test_config_is_read_and_written(checkpoint, tmp_path):
    path, _ = checkpoint
    cfg = read_config(path)
    assert (cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        "qwen3_moe",
        8,
        2,
        32,
    )
    assert cfg.norm_topk_prob and cfg.qk_norm and cfg.decoder_sparse_step == 1 and cfg.mlp_only_layers == ()
    # transformers writes the expert count as num_local_experts; the Hub's configs say num_experts.
    assert json.load(open(os.path.join(path, "config.json")))["num_local_experts"] == 8
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


def test_routing_matches_transformers_router(checkpoint):
    """Our top-k weights and experts equal HF's router on the same hidden states."""
    _, torch_model = checkpoint
    router = torch_model.model.layers[0].mlp.gate
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, ref_weights, ref_experts = router(x)
    probs, weights, experts = route(jnp.asarray(logits.numpy()), TOP_K, True)
    np.testing.assert_array_equal(np.asarray(experts), ref_experts.numpy())
    np.testing.assert_allclose(np.asarray(weights), ref_weights.numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(probs).sum(-1), 1.0, rtol=1e-6)


def test_dense_and_grouped_dispatch_agree():
    """Same numbers from both computations, on skewed routing that leaves some experts empty."""
    rng = np.random.default_rng(3)
    N, E, X, M, K = 37, 16, 8, 12, 3
    x = jnp.asarray(rng.normal(size=(N, E)), jnp.float32)
    logits = jnp.asarray(rng.normal(size=(N, X)) + np.array([3, 3, 2, 0, 0, -9, -9, -9]), jnp.float32)
    gate, up, down = (jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for s in ((X, E, M), (X, E, M), (X, M, E)))
    _, weights, experts = route(logits, K, False)
    assert 5 not in np.asarray(experts)  # an empty group
    dense = np.asarray(dense_experts(x, weights, experts, gate, up, down))
    grouped = np.asarray(jax.jit(grouped_experts)(x, weights, experts, gate, up, down))
    np.testing.assert_allclose(grouped, dense, rtol=1e-5, atol=1e-6)
    # And both equal the per-token definition sum_k w_k expert_k(x).
    ref = np.zeros((N, E), np.float32)
    for n in range(N):
        for k in range(K):
            e = int(experts[n, k])
            h = jax.nn.silu(x[n] @ gate[e]) * (x[n] @ up[e])
            ref[n] += float(weights[n, k]) * np.asarray(h @ down[e])
    np.testing.assert_allclose(dense, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_dense_and_grouped_models_agree_in_grad(checkpoint):
    """Gradients too (the trainer differentiates through either computation)."""
    path, _ = checkpoint
    ids = jnp.asarray(IDS, jnp.int32)

    def loss_of(dispatch):
        graphdef, params = split(load_hf(path, moe_dispatch=dispatch))
        from flax import nnx

        def loss(p):
            logits = nnx.merge(graphdef, p)(ids)
            return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, ids[..., None], -1)[..., 0])

        return jax.value_and_grad(loss)(params)

    (l_dense, g_dense), (l_grouped, g_grouped) = loss_of("dense"), loss_of("grouped")
    np.testing.assert_allclose(float(l_grouped), float(l_dense), rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-7), g_grouped, g_dense)


@pytest.mark.slow
def test_cached_decode_equals_full_forward(checkpoint):
    path, _ = checkpoint
    model = load_hf(path)
    ids = jnp.asarray(IDS[:, :16], jnp.int32)
    full = np.asarray(model(ids))
    cache = KVCache.zeros(model.config, batch=2, length=32)
    logits, cache = model(ids[:, :5], jnp.broadcast_to(jnp.arange(5), (2, 5)), cache=cache)
    steps = [np.asarray(logits)]
    for t in range(5, 16):
        logits, cache = model(ids[:, t : t + 1], jnp.full((2, 1), t, jnp.int32), cache=cache)
        steps.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=1e-5, atol=1e-5)


def test_save_hf_round_trips_through_transformers(checkpoint, tmp_path):
    path, torch_model = checkpoint
    save_hf(load_hf(path), str(tmp_path))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert type(reloaded) is type(torch_model)
    ref_state = torch_model.state_dict()
    for name, value in reloaded.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), ref_state[name].numpy(), err_msg=name)
    np.testing.assert_array_equal(hf_logits(reloaded, IDS), hf_logits(torch_model, IDS))


def test_fused_expert_tensors_load(checkpoint, tmp_path):
    """A checkpoint holding transformers 5's fused 3D expert tensors loads to the same model."""
    path, torch_model = checkpoint
    state = {k: v.contiguous() for k, v in torch_model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    ours, ref = split(load_hf(str(tmp_path)))[1], split(load_hf(path))[1]
    jax.tree.map(np.testing.assert_array_equal, ours, ref)


def test_sparse_step_and_mlp_only_layers(tmp_path):
    """decoder_sparse_step=2 with 4 layers and mlp_only_layers=[3]: only layer 1 is sparse."""
    torch_model = make_moe_checkpoint(
        tmp_path, num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False
    )
    model = load_hf(str(tmp_path))
    assert [model.config.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert _rel_err(np.asarray(model(jnp.asarray(IDS, jnp.int32))), hf_logits(torch_model, IDS)) < 1e-3
    _, routing = model(jnp.asarray(IDS, jnp.int32), return_routing=True)
    assert len(routing) == 1


def test_unsupported_fields_are_refused(checkpoint, tmp_path):
    path, _ = checkpoint
    hf = json.load(open(os.path.join(path, "config.json")))
    with pytest.raises(ValueError, match="shared_expert_intermediate_size=128"):
        ModelConfig.from_hf({**hf, "shared_expert_intermediate_size": 128})
    with pytest.raises(ValueError, match="'moe_intermediate_size' is missing"):
        ModelConfig.from_hf({k: v for k, v in hf.items() if k != "moe_intermediate_size"})
    with pytest.raises(ValueError, match="num_experts_per_tok=9; expected 1..num_experts=8"):
        ModelConfig.from_hf({**hf, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="moe_dispatch='sparse'"):
        read_config(path).replace(moe_dispatch="sparse")
    # A tensor missing from the checkpoint is named.
    from safetensors.numpy import load_file
    from safetensors.numpy import save_file as save_np

    tensors = load_file(os.path.join(path, "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_np(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.1.mlp.experts.3.up_proj.weight'\]"):
        load_hf(str(tmp_path))


def test_router_statistics_match_transformers_aux_loss(tmp_path):
    """On one MoE layer our load-balancing loss is HF's `load_balancing_loss_func` (with a padding
    mask), and the load histogram counts the masked tokens' top-k choices."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    torch_model = make_moe_checkpoint(tmp_path, num_hidden_layers=1)
    mask = np.ones((2, 24), np.float32)
    mask[1, 15:] = 0
    with torch.no_grad():
        out = torch_model(torch.as_tensor(IDS), output_router_logits=True)
        ref = load_balancing_loss_func(out.router_logits, EXPERTS, TOP_K, torch.as_tensor(mask))
    model = load_hf(str(tmp_path))
    _, routing = model(jnp.asarray(IDS, jnp.int32), return_routing=True)
    np.testing.assert_allclose(float(load_balancing_loss(routing, jnp.asarray(mask))), float(ref), rtol=1e-5)
    load = np.asarray(expert_load(routing[0], jnp.asarray(mask)))
    experts = torch.topk(out.router_logits[0], TOP_K, dim=-1).indices.numpy().reshape(2, 24, TOP_K)
    expected = np.bincount(experts[mask > 0].reshape(-1), minlength=EXPERTS)
    np.testing.assert_array_equal(load, expected)
    assert load.sum() == TOP_K * mask.sum()


@pytest.mark.slow
def test_sharded_forward_equals_unsharded(checkpoint):
    """Experts over the `expert` mesh axis (trainer mesh fsdp 2 x expert 4, rollout mesh expert 4
    x tensor 2), both dispatches: the same logits as one device."""
    path, _ = checkpoint
    ids = jnp.asarray(IDS, jnp.int32)
    ref = np.asarray(load_hf(path)(ids))
    layouts = [({"fsdp": 2, "expert": 4}, sharding.TRAINER_RULES), ({"expert": 4, "tensor": 2}, sharding.ROLLOUT_RULES)]
    for shape, rules in layouts:
        mesh = sharding.make_mesh(jax.devices()[:8], shape)
        for dispatch in ("dense", "grouped"):
            model = load_hf(path, mesh=mesh, rules=rules, moe_dispatch=dispatch)
            gate = model.layers[0].mlp.gate_XEM[...]
            assert gate.sharding.spec[0] == "expert" and len(gate.addressable_shards[0].data) == EXPERTS // 4
            graphdef, params = split(model)
            from flax import nnx

            out = jax.jit(lambda p, x, graphdef=graphdef: nnx.merge(graphdef, p)(x))(params, ids)
            np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5, err_msg=f"{shape} {dispatch}")


@pytest.mark.slow
def test_fresh_moe_model_has_expert_axes():
    cfg = ModelConfig(
        model_type="qwen3_moe",
        qk_norm=True,
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
    )
    axes = logical_axes(init_model(cfg))
    mlp = axes["layers"][0]["mlp"]
    assert tuple(mlp["gate_XEM"]) == ("expert", "embed", "mlp") and tuple(mlp["down_XME"]) == ("expert", "mlp", "embed")
    assert tuple(mlp["router_EX"]) == ("embed", None)


def _load_config(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        name, os.path.join(os.path.dirname(__file__), "..", "..", "configs", f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def test_smoke_configs_build_a_moe_and_a_dense_model():
    from dora_jax.runtime import run_config
    from dora_jax.runtime.build import fresh_model_config

    moe = fresh_model_config(run_config.parse(_load_config("smoke_moe")), 20, (2,))
    assert (moe.model_type, moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (
        "qwen3_moe",
        8,
        2,
        128,
    )
    assert (
        moe.norm_topk_prob and moe.moe_dispatch == "dense" and all(moe.is_moe_layer(i) for i in range(moe.num_layers))
    )
    dense = fresh_model_config(run_config.parse(_load_config("smoke")), 20, (2,))
    assert dense.model_type == "qwen3" and dense.num_experts == 0 and not dense.is_moe_layer(0)
    bad = _load_config("smoke_moe")
    bad.model.moe_dispatch = "sparse"
    with pytest.raises(ValueError, match="model.moe_dispatch='sparse'"):
        run_config.parse(bad)


@pytest.mark.parametrize(
    "shape",
    [{"fsdp": 2, "expert": 2, "tensor": 2}, {"fsdp": 4, "expert": 2}, {"data": 2, "expert": 4}, {"tensor": 8}],
    ids=["fsdp2-expert2-tensor2", "fsdp4-expert2", "data2-expert4", "tensor8"],
)
def test_megablox_expert_parallelism_equals_the_ragged_dot_rule(shape):
    """moe_dispatch="megablox": every expert projection in the megablox kernels (Pallas interpreter
    here): the same outputs and gradients as "grouped" (JAX's own ragged-dot rule), on one device and
    on a trainer mesh of 8 with an empty expert among them; on the mesh each device routes and
    sorts only its batch shard's assignments (N x K / batch shards), never the whole batch."""
    from flax.core import spmd

    from dora_jax.models import moe

    rng = np.random.default_rng(5)
    N, E, X, M, K = 60, 32, 8, 16, 2  # 60 tokens: padded to a multiple of the 8 devices
    x = jnp.asarray(rng.normal(size=(N, E)), jnp.float32)
    logits = jnp.asarray(rng.normal(size=(N, X)) + np.array([3, 3, 2, 0, 0, -9, 0, 1]), jnp.float32)
    gate, up, down = (jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for s in ((X, E, M), (X, E, M), (X, M, E)))
    _, weights, experts = route(logits, K, False)
    assert 5 not in np.asarray(experts)  # an empty group

    def loss(compute, x, gate, up, down):
        y = compute(x, weights, experts, gate, up, down)
        return jnp.sum(jnp.sin(y)), y

    grad = jax.value_and_grad(loss, argnums=(1, 2, 3, 4), has_aux=True)
    (_, ref_y), ref_grads = jax.jit(functools.partial(grad, moe.grouped_experts))(x, gate, up, down)
    kernel = functools.partial(grad, moe._COMPUTE["megablox_interpret"])
    (_, got_y), got_grads = jax.jit(kernel)(x, gate, up, down)
    for got, ref in zip((got_y, *got_grads), (ref_y, *ref_grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-5)
    assert float(jnp.abs(ref_grads[1][5]).max()) == 0.0 and float(jnp.abs(ref_grads[1][0]).max()) > 0

    mesh = sharding.make_mesh(jax.devices()[:8], shape)
    put = lambda a, spec: jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))  # noqa: E731
    P = jax.sharding.PartitionSpec
    args = (put(x, P("fsdp")), put(gate, P("expert", "fsdp", "tensor")), put(up, P("expert", "fsdp", "tensor")))
    args += (put(down, P("expert", "tensor", "fsdp")),)
    with jax.set_mesh(mesh), spmd.logical_axis_rules(sharding.TRAINER_RULES):
        (_, sharded_y), sharded_grads = jax.jit(kernel)(*args)
        hlo = jax.jit(kernel).lower(*args).compile().as_text()
    for got, ref in zip((sharded_y, *sharded_grads), (ref_y, *ref_grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-5)
    batch_shards = shape.get("data", 1) * shape.get("fsdp", 1)
    sorted_rows = {int(n) for n in re.findall(r"\(s32\[(\d+)\]\{0\}, s32\[\d+\]\{0\}\) sort\(", hlo)}
    assert sorted_rows == {64 * K // batch_shards}  # 60 tokens padded to 64, split over the batch shards
