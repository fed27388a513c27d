"""HF checkpoint I/O: `load_hf(path)` reads a transformers checkpoint directory into our decoder,
`save_hf(model, path)` writes one that transformers loads.

The name map is one table (`_weight_map`): HF tensor name, our params path, and how the layout
changes (HF stores Linear weights as [out, in]; we store [in, heads, head_dim] style kernels).
Every expected tensor must be present with the expected shape and nothing unknown may be left
over: a partial load is an error, never silence.
"""

from __future__ import annotations

import json
import os
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from dora_jax import sharding as sharding_lib
from dora_jax.models.config import ModelConfig
from dora_jax.models.decoder import Decoder, init_model

# Tensors transformers keeps as buffers in some versions; never weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _weight_map(cfg: ModelConfig):
    """[(hf_name, path, to_ours, to_hf)] for every parameter of `cfg`'s decoder."""
    E, H, K, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    same = (lambda w: w, lambda w: w)

    def linear(*shape):  # HF [out, in] -> ours [in, *out_dims]
        return (lambda w: w.T.reshape(shape), lambda w: w.reshape(shape[0], -1).T)

    def linear_out(*shape):  # HF [E, H*D] -> ours [H, D, E]
        return (lambda w: w.T.reshape(shape), lambda w: w.reshape(-1, shape[-1]).T)

    def bias(*shape):
        return (lambda w: w.reshape(shape), lambda w: w.reshape(-1))

    entries = [("model.embed_tokens.weight", ("embed_VE",), *same), ("model.norm.weight", ("final_norm", "scale"), *same)]
    if not cfg.tie_word_embeddings:
        entries.append(("lm_head.weight", ("lm_head_EV",), lambda w: w.T, lambda w: w.T))
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", ("layers", i)
        entries += [
            (hf + "input_layernorm.weight", ours + ("input_norm", "scale"), *same),
            (hf + "post_attention_layernorm.weight", ours + ("post_attn_norm", "scale"), *same),
            (hf + "self_attn.q_proj.weight", ours + ("attn", "q_EHD"), *linear(E, H, D)),
            (hf + "self_attn.k_proj.weight", ours + ("attn", "k_EKD"), *linear(E, K, D)),
            (hf + "self_attn.v_proj.weight", ours + ("attn", "v_EKD"), *linear(E, K, D)),
            (hf + "self_attn.o_proj.weight", ours + ("attn", "o_HDE"), *linear_out(H, D, E)),
            (hf + "mlp.gate_proj.weight", ours + ("mlp", "gate_EM"), lambda w: w.T, lambda w: w.T),
            (hf + "mlp.up_proj.weight", ours + ("mlp", "up_EM"), lambda w: w.T, lambda w: w.T),
            (hf + "mlp.down_proj.weight", ours + ("mlp", "down_ME"), lambda w: w.T, lambda w: w.T),
        ]
        if cfg.attention_bias:
            entries += [
                (hf + "self_attn.q_proj.bias", ours + ("attn", "q_bias_HD"), *bias(H, D)),
                (hf + "self_attn.k_proj.bias", ours + ("attn", "k_bias_KD"), *bias(K, D)),
                (hf + "self_attn.v_proj.bias", ours + ("attn", "v_bias_KD"), *bias(K, D)),
            ]
        if cfg.attention_out_bias:
            entries.append((hf + "self_attn.o_proj.bias", ours + ("attn", "o_bias_E"), *same))
        if cfg.qk_norm:
            entries += [
                (hf + "self_attn.q_norm.weight", ours + ("attn", "q_norm", "scale"), *same),
                (hf + "self_attn.k_norm.weight", ours + ("attn", "k_norm", "scale"), *same),
            ]
    return entries


def _tensor_files(path: str) -> dict[str, str]:
    """tensor name -> safetensors file, from model.safetensors or a sharded index."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json found")
    with safe_open(single, framework="flax") as f:
        return {name: single for name in f.keys()}


def _set_path(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get_path(tree, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def read_config(path: str, *, dtype=jnp.float32, param_dtype=None) -> ModelConfig:
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(config_file):
        raise FileNotFoundError(f"{config_file}: not found; expected a HF checkpoint directory")
    with open(config_file) as f:
        return ModelConfig.from_hf(json.load(f), dtype=dtype, param_dtype=param_dtype, source=config_file)


def load_hf(
    path: str,
    dtype=jnp.float32,
    *,
    param_dtype=None,
    mesh: jax.sharding.Mesh | None = None,
    rules: sharding_lib.Rules = sharding_lib.TRAINER_RULES,
) -> Decoder:
    """Loads a HF Llama/Qwen2/Qwen3 checkpoint directory as our decoder.

    `dtype` is the compute dtype; params are stored in `param_dtype` (default: `dtype`). With a
    `mesh`, every param is placed directly with its target sharding: each device receives only
    its own shard (`make_array_from_callback`), never a full copy per device.
    """
    cfg = read_config(path, dtype=dtype, param_dtype=param_dtype)
    files = _tensor_files(path)
    abstract = nnx.eval_shape(lambda: init_model(cfg))
    graphdef, abstract_state = nnx.split(abstract)
    shapes = nnx.to_pure_dict(abstract_state)
    axes = nnx.to_pure_dict(nnx.get_partition_spec(abstract_state)) if mesh is not None else None
    expected = _weight_map(cfg)
    missing = [name for name, *_ in expected if name not in files]
    if missing:
        raise ValueError(f"{path}: checkpoint is missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    known = {name for name, *_ in expected}
    unexpected = sorted(n for n in files if n not in known and not n.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        raise ValueError(
            f"{path}: checkpoint has tensors this {cfg.model_type} config does not use: {unexpected[:5]} "
            "(unsupported architecture variant?)"
        )

    params: dict = {}
    handles: dict[str, object] = {}
    try:
        for name, ours, to_ours, _ in expected:
            file = files[name]
            if file not in handles:
                handles[file] = safe_open(file, framework="flax").__enter__()
            target = _get_path(shapes, ours)
            raw = np.asarray(handles[file].get_tensor(name))
            value = to_ours(raw) if raw.size == np.prod(target.shape) else None
            if value is None or value.shape != target.shape:
                raise ValueError(
                    f"{file}: tensor {name} has shape {tuple(raw.shape)}, expected one that maps to "
                    f"{tuple(target.shape)} for this config"
                )
            _set_path(params, ours, _place(value, cfg.param_dtype, mesh, axes and _get_path(axes, ours), rules))
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    return nnx.merge(graphdef, params)


def _place(value: np.ndarray, dtype, mesh, names, rules) -> jax.Array:
    value = value.astype(jnp.dtype(dtype))
    if mesh is None:
        return jnp.asarray(value)
    sharding = sharding_lib.logical_sharding(tuple(names), value.shape, mesh, rules)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def save_hf(model: Decoder, path: str) -> None:
    """Writes `config.json` + `model.safetensors` that transformers' *ForCausalLM loads."""
    from safetensors.numpy import save_file

    cfg = model.config
    os.makedirs(path, exist_ok=True)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tensors: dict[str, np.ndarray] = {}
    for name, ours, _, to_hf in _weight_map(cfg):
        value = np.asarray(jax.device_get(_get_path(params, ours)))
        tensors[name] = np.ascontiguousarray(to_hf(value))
    if jnp.dtype(cfg.param_dtype) == jnp.bfloat16:
        _save_bf16(tensors, os.path.join(path, "model.safetensors"))
    else:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf(), f, indent=2)


def _save_bf16(tensors: dict[str, np.ndarray], file: str) -> None:
    from safetensors.flax import save_file

    save_file({k: jnp.asarray(v, jnp.bfloat16) for k, v in tensors.items()}, file, metadata={"format": "pt"})

