"""Our decoder against HF transformers on tiny random Llama / Qwen2 / Qwen3 checkpoints."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from dora_jax.models import KVCache, load_hf, save_hf
from tests.models.hf_fixtures import VOCAB, hf_logits, make_checkpoint

KINDS = ["llama", "qwen2", "qwen3"]


def _rel_err(ours, ref):
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    torch_model = make_checkpoint(request.param, path)
    return request.param, str(path), torch_model


def test_logits_match_transformers(checkpoint):
    kind, path, torch_model = checkpoint
    ids = np.random.default_rng(0).integers(0, VOCAB, size=(2, 48))  # past llama3's original ctx (32)
    ours = np.asarray(load_hf(path, dtype=jnp.float32)(jnp.asarray(ids, jnp.int32)))
    ref = hf_logits(torch_model, ids)
    assert ours.shape == ref.shape == (2, 48, VOCAB)
    assert _rel_err(ours, ref) < 1e-3, kind


def test_config_features_are_read(checkpoint):
    kind, path, _ = checkpoint
    cfg = load_hf(path).config
    expected = {
        "llama": dict(rope_kind="llama3", attention_bias=False, qk_norm=False, tie=False, head_dim=16, kv=2),
        "qwen2": dict(rope_kind="default", attention_bias=True, qk_norm=False, tie=True, head_dim=16, kv=2),
        "qwen3": dict(rope_kind="default", attention_bias=False, qk_norm=True, tie=False, head_dim=24, kv=1),
    }[kind]
    got = dict(
        rope_kind=cfg.rope.kind,
        attention_bias=cfg.attention_bias,
        qk_norm=cfg.qk_norm,
        tie=cfg.tie_word_embeddings,
        head_dim=cfg.head_dim,
        kv=cfg.num_kv_heads,
    )
    assert got == expected


@pytest.mark.slow
def test_cached_decode_equals_full_forward(checkpoint):
    _, path, _ = checkpoint
    model = load_hf(path)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, size=(2, 20)), jnp.int32)
    full = np.asarray(model(ids))
    cache = KVCache.zeros(model.config, batch=2, length=32)
    prompt_len = 7
    logits, cache = model(ids[:, :prompt_len], jnp.broadcast_to(jnp.arange(prompt_len), (2, prompt_len)), cache=cache)
    steps = [np.asarray(logits)]
    for t in range(prompt_len, 20):
        logits, cache = model(ids[:, t : t + 1], jnp.full((2, 1), t, jnp.int32), cache=cache)
        steps.append(np.asarray(logits))
    incremental = np.concatenate(steps, axis=1)
    np.testing.assert_allclose(incremental, full, rtol=1e-5, atol=1e-5)


def test_save_hf_round_trips_through_transformers(checkpoint, tmp_path):
    kind, path, torch_model = checkpoint
    model = load_hf(path)
    out = tmp_path / "saved"
    save_hf(model, str(out))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(reloaded) is type(torch_model)
    ids = np.random.default_rng(2).integers(0, VOCAB, size=(1, 40))
    np.testing.assert_allclose(hf_logits(reloaded, ids), hf_logits(torch_model, ids), rtol=1e-5, atol=1e-5)
    ours_again = np.asarray(load_hf(str(out))(jnp.asarray(ids, jnp.int32)))
    np.testing.assert_allclose(ours_again, hf_logits(torch_model, ids), rtol=1e-3, atol=1e-4)


def test_bf16_params_and_compute(checkpoint):
    _, path, torch_model = checkpoint
    model = load_hf(path, dtype=jnp.bfloat16)
    leaf = model.layers[0].mlp.gate_EM[...]
    assert leaf.dtype == jnp.bfloat16
    ids = np.random.default_rng(3).integers(0, VOCAB, size=(1, 16))
    ours = np.asarray(model(jnp.asarray(ids, jnp.int32)))
    assert _rel_err(ours, hf_logits(torch_model, ids)) < 5e-2  # bf16 has ~3 significant digits


# ------------------------------------------------------------------------------------ bad input
@pytest.fixture()
def llama_dir(tmp_path):
    make_checkpoint("llama", tmp_path)
    return tmp_path


def test_unsupported_architecture_is_named(llama_dir):
    config = json.loads((llama_dir / "config.json").read_text())
    config["model_type"] = "gpt2"
    (llama_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json: model_type='gpt2' is not supported"):
        load_hf(str(llama_dir))


def test_missing_tensor_is_named(llama_dir):
    from safetensors.numpy import load_file, save_file

    file = str(llama_dir / "model.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file)
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"):
        load_hf(str(llama_dir))


def test_shape_mismatch_is_named(llama_dir):
    from safetensors.numpy import load_file, save_file

    file = str(llama_dir / "model.safetensors")
    tensors = load_file(file)
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"][:16]
    save_file(tensors, file)
    with pytest.raises(ValueError, match=r"k_proj.weight has shape \(16, 64\)"):
        load_hf(str(llama_dir))


def test_unknown_tensor_is_refused(llama_dir):
    from safetensors.numpy import load_file, save_file

    file = str(llama_dir / "model.safetensors")
    tensors = load_file(file)
    tensors["model.layers.0.mlp.extra.weight"] = np.zeros((2, 2), np.float32)
    save_file(tensors, file)
    with pytest.raises(ValueError, match=r"does not use: \['model.layers.0.mlp.extra.weight'\]"):
        load_hf(str(llama_dir))


def test_sharded_checkpoint_with_index(tmp_path):
    torch.manual_seed(0)
    from tests.models.hf_fixtures import qwen3_config

    model = transformers.AutoModelForCausalLM.from_config(qwen3_config(), dtype=torch.float32).eval()
    model.save_pretrained(str(tmp_path), max_shard_size="100KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    ids = np.random.default_rng(4).integers(0, VOCAB, size=(1, 12))
    ours = np.asarray(load_hf(str(tmp_path))(jnp.asarray(ids, jnp.int32)))
    assert _rel_err(ours, hf_logits(model, ids)) < 1e-3
