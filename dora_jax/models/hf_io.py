"""HF checkpoint I/O: `load_hf(path)` reads a transformers checkpoint directory into our decoder,
`save_hf(model, path)` writes one that transformers loads.

The name map is one table (`_weight_map`): HF tensor names, our params path, and how the layout
changes (HF stores Linear weights as [out, in]; we store [in, heads, head_dim] style kernels).
Most params are one HF tensor; a MoE layer's stacked experts `gate_XEM` are the X tensors
`mlp.experts.{j}.gate_proj.weight` (the Hub's layout, and what transformers' save_pretrained
writes), or one slice of the fused `mlp.experts.gate_up_proj` [X, 2M, E] that transformers 5
holds in memory (read, never written).
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

from dora_jax.models.config import ModelConfig
from dora_jax.models.decoder import Decoder, init_model
from dora_jax.parallel import sharding as sharding_lib

# Tensors transformers keeps as buffers in some versions; never weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _weight_map(cfg: ModelConfig, fused_experts: frozenset[int] = frozenset()):
    """[(hf_names, path, to_ours, to_hf)] for every parameter of `cfg`'s decoder: `to_ours` maps
    the list of HF arrays to ours, `to_hf` ours to the list. MoE layers in `fused_experts` read
    the fused 3D expert tensors."""
    entries = [
        ((name,), ours, lambda ws, f=to_ours: f(ws[0]), lambda w, f=to_hf: [f(w)])
        for name, ours, to_ours, to_hf in _single_map(cfg)
    ]
    for i in range(cfg.num_layers):
        if cfg.is_moe_layer(i):
            entries += _expert_map(cfg, i, fused=i in fused_experts)
    return entries


def _expert_map(cfg: ModelConfig, i: int, *, fused: bool):
    hf, ours, X, M = f"model.layers.{i}.mlp.", ("layers", i, "mlp"), cfg.num_experts, cfg.moe_intermediate_size
    entries = [((hf + "gate.weight",), ours + ("router_EX",), lambda ws: ws[0].T, lambda w: [w.T])]
    if fused:  # gate_up_proj [X, 2M, E] (gate rows first), down_proj [X, E, M]
        return entries + [
            ((hf + "experts.gate_up_proj",), ours + ("gate_XEM",), lambda ws: _split_gate_up(ws[0], M, 0), None),
            ((hf + "experts.gate_up_proj",), ours + ("up_XEM",), lambda ws: _split_gate_up(ws[0], M, 1), None),
            ((hf + "experts.down_proj",), ours + ("down_XME",), lambda ws: ws[0].transpose(0, 2, 1), None),
        ]
    stacked = (lambda ws: np.stack([w.T for w in ws]), lambda w: [e.T for e in w])
    for hf_proj, our_name in (("gate_proj", "gate_XEM"), ("up_proj", "up_XEM"), ("down_proj", "down_XME")):
        names = tuple(f"{hf}experts.{j}.{hf_proj}.weight" for j in range(X))
        entries.append((names, ours + (our_name,), *stacked))
    return entries


def _split_gate_up(w_X2ME, M: int, half: int):
    if w_X2ME.ndim != 3 or w_X2ME.shape[1] != 2 * M:
        return w_X2ME  # the caller's shape check names the tensor
    return w_X2ME[:, half * M : (half + 1) * M, :].transpose(0, 2, 1)


def _single_map(cfg: ModelConfig):
    """[(hf_name, path, to_ours, to_hf)] for every parameter that is one HF tensor."""
    E, H, K, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    same = (lambda w: w, lambda w: w)

    def linear(*shape):  # HF [out, in] -> ours [in, *out_dims]
        return (lambda w: w.T.reshape(shape), lambda w: w.reshape(shape[0], -1).T)

    def linear_out(*shape):  # HF [E, H*D] -> ours [H, D, E]
        return (lambda w: w.T.reshape(shape), lambda w: w.reshape(-1, shape[-1]).T)

    def bias(*shape):
        return (lambda w: w.reshape(shape), lambda w: w.reshape(-1))

    entries = [
        ("model.embed_tokens.weight", ("embed_VE",), *same),
        ("model.norm.weight", ("final_norm", "scale"), *same),
    ]
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
        ]
        if not cfg.is_moe_layer(i):
            entries += [
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
    moe_dispatch: str | None = None,
    attention: str | None = None,
    remat: str | None = None,
    scan_layers: bool | None = None,
) -> Decoder:
    """Loads a HF Llama/Qwen2/Qwen3/Qwen3-MoE checkpoint directory as our decoder.

    `dtype` is the compute dtype; params are stored in `param_dtype` (default: `dtype`). With a
    `mesh`, every param is placed directly with its target sharding: each device receives only
    its own shard (`make_array_from_callback`), never a full copy per device. `moe_dispatch`
    ("dense" | "grouped") overrides the config's MoE computation, `attention` its attention kernel,
    `remat` its rematerialisation policy and `scan_layers` its layer loop (ModelConfig.COMPUTE_FIELDS:
    none changes a number).
    """
    cfg = read_config(path, dtype=dtype, param_dtype=param_dtype)
    compute = dict(moe_dispatch=moe_dispatch, attention=attention, remat=remat, scan_layers=scan_layers)
    cfg = cfg.replace(**{k: v for k, v in compute.items() if v is not None})
    files = _tensor_files(path)
    abstract = nnx.eval_shape(lambda: init_model(cfg))
    graphdef, abstract_state = nnx.split(abstract)
    shapes = nnx.to_pure_dict(abstract_state)
    axes = nnx.to_pure_dict(nnx.get_partition_spec(abstract_state)) if mesh is not None else None
    fused = frozenset(i for i in range(cfg.num_layers) if f"model.layers.{i}.mlp.experts.gate_up_proj" in files)
    expected = _weight_map(cfg, fused)
    missing = list(dict.fromkeys(name for names, *_ in expected for name in names if name not in files))
    if missing:
        raise ValueError(f"{path}: checkpoint is missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    known = {name for names, *_ in expected for name in names}
    unexpected = sorted(n for n in files if n not in known and not n.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        raise ValueError(
            f"{path}: checkpoint has tensors this {cfg.model_type} config does not use: {unexpected[:5]} "
            "(unsupported architecture variant?)"
        )

    params: dict = {}
    handles: dict[str, object] = {}
    try:
        for names, ours, to_ours, _ in expected:
            raws = []
            for name in names:
                file = files[name]
                if file not in handles:
                    handles[file] = safe_open(file, framework="flax").__enter__()
                raws.append(np.asarray(handles[file].get_tensor(name)))
            target = _get_path(shapes, ours)
            value = _convert(to_ours, raws)
            if value is None or value.shape != target.shape:
                shapes_seen = sorted(set(tuple(r.shape) for r in raws))
                raise ValueError(
                    f"{files[names[0]]}: tensor {names[0] if len(names) == 1 else names[0] + ' ...'} has shape "
                    f"{shapes_seen[0] if len(shapes_seen) == 1 else shapes_seen}, expected one that maps to "
                    f"{tuple(target.shape)} for this config"
                )
            _set_path(params, ours, _place(value, cfg.param_dtype, mesh, axes and _get_path(axes, ours), rules))
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    return nnx.merge(graphdef, params)


def _convert(to_ours, raws: list[np.ndarray]) -> np.ndarray | None:
    """`to_ours(raws)`, or None where the HF shapes cannot map (the caller names the tensor)."""
    if len({r.shape for r in raws}) != 1:
        return None
    try:
        return to_ours(raws)
    except ValueError:  # a reshape of the wrong size
        return None


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
    for names, ours, _, to_hf in _weight_map(cfg):
        value = np.asarray(jax.device_get(_get_path(params, ours)))
        for name, array in zip(names, to_hf(value), strict=True):
            tensors[name] = np.ascontiguousarray(array)
    if jnp.dtype(cfg.param_dtype) == jnp.bfloat16:
        _save_bf16(tensors, os.path.join(path, "model.safetensors"))
    else:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf(), f, indent=2)


def _save_bf16(tensors: dict[str, np.ndarray], file: str) -> None:
    from safetensors.flax import save_file

    save_file({k: jnp.asarray(v, jnp.bfloat16) for k, v in tensors.items()}, file, metadata={"format": "pt"})
