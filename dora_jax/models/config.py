"""Model configuration: one frozen dataclass for Llama / Qwen2 / Qwen3 (dense) and Qwen3-MoE.

`ModelConfig.from_hf(dict)` reads a HF `config.json`; `to_hf()` writes one back. Unsupported
architectures and options are refused with an error naming the field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
_HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_QK_NORM_TYPES = ("qwen3", "qwen3_moe")
MOE_DISPATCHES = ("dense", "grouped", "megablox", "megablox_interpret")  # see dora_jax.models.moe
REMAT_POLICIES = ("none", "dots", "full")  # see dora_jax.models.decoder.Decoder
# Fields that choose how the numbers are computed, not what they are: a checkpoint or a resumed run
# may change them.
COMPUTE_FIELDS = ("moe_dispatch", "attention", "remat", "scan_layers")
ATTENTION_IMPLEMENTATIONS = ("auto", "reference", "xla", "cudnn", "pallas_tpu", "pallas_interpret")  # see .attention
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: `kind` is "default" (plain) or "llama3" (Llama 3.1 frequency scaling)."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder hyper-parameters. Field names follow HF where they exist."""

    model_type: str = "llama"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    attention_bias: bool = False  # q/k/v projection biases (Qwen2)
    attention_out_bias: bool = False  # o_proj bias (Llama/Qwen3 with attention_bias=true)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    param_dtype: Any = jnp.float32
    dtype: Any = jnp.float32  # compute dtype
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # Mixture of experts (model_type "qwen3_moe"; num_experts = 0 is a dense model).
    num_experts: int = 0  # X routed experts per MoE layer
    num_experts_per_tok: int = 0  # K experts per token (top-k)
    moe_intermediate_size: int = 0  # each expert's SwiGLU width
    norm_topk_prob: bool = False  # renormalise the K routing weights to sum to 1
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here (dense SwiGLU instead)
    moe_dispatch: str = "grouped"  # "dense" | "grouped" | "megablox" (TPU: expert parallel): same numbers (models.moe)
    # Full-forward attention kernel (dora_jax.models.attention): "auto" (splash on TPU, cuDNN on
    # GPU, the reference on CPU) | "reference" | "xla" | "cudnn" | "pallas_tpu" | "pallas_interpret".
    attention: str = "auto"
    # Full forward, per layer: "none" keeps every activation for the backward pass; "dots" keeps
    # only the weight matmuls' outputs and recomputes the rest; "full" keeps each layer's input only.
    remat: str = "none"
    # Full forward: the blocks run as one `lax.scan` over their params stacked along a layer axis
    # (cast to `dtype` first: every block casts them so before use), so XLA compiles one block
    # instead of `num_layers`. Same numbers; needs blocks of one kind (all dense or all MoE).
    scan_layers: bool = False

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type={self.model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        # save_hf must write what transformers (and load_hf) read back for this model_type.
        if self.qk_norm != (self.model_type in _QK_NORM_TYPES):
            raise ValueError(
                f"qk_norm={self.qk_norm} does not match model_type={self.model_type!r} "
                f"(q/k RMSNorm is what makes a Qwen3; expected qk_norm == (model_type in {_QK_NORM_TYPES}))"
            )
        self._check_moe()
        if self.model_type == "qwen2" and (not self.attention_bias or self.attention_out_bias):
            raise ValueError(
                "model_type='qwen2' has q/k/v biases and no o_proj bias: expected "
                "attention_bias=True, attention_out_bias=False"
            )
        if self.model_type != "qwen2" and self.attention_bias != self.attention_out_bias:
            raise ValueError(
                f"model_type={self.model_type!r} biases all of q/k/v/o or none: attention_bias="
                f"{self.attention_bias} and attention_out_bias={self.attention_out_bias} must match"
            )
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat={self.remat!r}; expected one of {REMAT_POLICIES}")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"attention={self.attention!r}; expected one of {ATTENTION_IMPLEMENTATIONS}")
        if self.scan_layers and len({self.is_moe_layer(i) for i in range(self.num_layers)}) > 1:
            raise ValueError(
                "scan_layers=True needs blocks of one kind, but this model mixes dense and MoE blocks "
                f"(decoder_sparse_step={self.decoder_sparse_step}, mlp_only_layers={self.mlp_only_layers}); "
                "expected scan_layers=False"
            )
        if self.rope.kind not in ("default", "llama3"):
            raise ValueError(f"rope kind {self.rope.kind!r} not supported; expected 'default' or 'llama3'")

    def _check_moe(self):
        if (self.num_experts > 0) != (self.model_type == "qwen3_moe"):
            raise ValueError(
                f"num_experts={self.num_experts} does not match model_type={self.model_type!r} "
                "(experts are what makes a qwen3_moe; expected num_experts >= 1 exactly for qwen3_moe)"
            )
        if not self.num_experts:
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok}; expected 1..num_experts={self.num_experts}"
            )
        if self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size={self.moe_intermediate_size}; expected >= 1")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step={self.decoder_sparse_step}; expected >= 1")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"mlp_only_layers={list(self.mlp_only_layers)} has {bad} outside 0..{self.num_layers - 1}")
        if self.moe_dispatch not in MOE_DISPATCHES:
            raise ValueError(f"moe_dispatch={self.moe_dispatch!r}; expected one of {MOE_DISPATCHES}")

    def is_moe_layer(self, layer: int) -> bool:
        """HF Qwen3-MoE's rule: sparse unless listed in mlp_only_layers or off the sparse step."""
        return (
            self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    # ------------------------------------------------------------------ HF I/O
    @classmethod
    def from_hf(cls, hf: dict, *, dtype=jnp.float32, param_dtype=None, source: str = "config.json"):
        """Builds a config from a HF config dict; `source` names the file in error messages."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{source}: model_type={model_type!r} is not supported; expected one of "
                f"{SUPPORTED_MODEL_TYPES} (dense Llama 3.x, Qwen2/2.5, Qwen3; Qwen3-MoE)"
            )
        if hf.get("use_sliding_window"):
            raise ValueError(f"{source}: use_sliding_window=true is not supported; expected false")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{source}: hidden_act={act!r} is not supported; expected 'silu'")
        if hf.get("mlp_bias"):
            raise ValueError(f"{source}: mlp_bias=true is not supported; expected false")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in hf:
                raise ValueError(f"{source}: required field {key!r} is missing")
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        rope = _rope_from_hf(hf, source)
        moe = _moe_from_hf(hf, source) if model_type == "qwen3_moe" else {}
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope=rope,
            # Qwen2 always has q/k/v biases and none on o_proj; Llama/Qwen3 bias all four or none.
            attention_bias=True if model_type == "qwen2" else bool(hf.get("attention_bias", False)),
            attention_out_bias=False if model_type == "qwen2" else bool(hf.get("attention_bias", False)),
            qk_norm=model_type in _QK_NORM_TYPES,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            param_dtype=param_dtype or dtype,
            dtype=dtype,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=_as_eos(hf.get("eos_token_id")),
            **moe,
        )

    def to_hf(self) -> dict:
        """A HF config dict that transformers loads as the matching *ForCausalLM."""
        rope_parameters: dict[str, Any] = {"rope_theta": self.rope.theta, "rope_type": self.rope.kind}
        if self.rope.kind == "llama3":
            rope_parameters.update(
                factor=self.rope.factor,
                low_freq_factor=self.rope.low_freq_factor,
                high_freq_factor=self.rope.high_freq_factor,
                original_max_position_embeddings=self.rope.original_max_position_embeddings,
            )
        hf = {
            "architectures": [_HF_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta,
            "rope_parameters": rope_parameters,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "dtype": _dtype_name(self.param_dtype),
        }
        if self.rope.kind == "llama3":
            hf["rope_scaling"] = dict(rope_parameters)
        if self.model_type == "llama":
            hf["attention_bias"] = self.attention_bias
            hf["mlp_bias"] = False
        if self.model_type in _QK_NORM_TYPES:
            hf["attention_bias"] = self.attention_bias
        if self.model_type == "qwen3_moe":
            hf.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
            )
        if self.bos_token_id is not None:
            hf["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            hf["eos_token_id"] = self.eos_token_id if isinstance(self.eos_token_id, int) else list(self.eos_token_id)
        return hf


def moe_fields(m) -> dict:
    """The ModelConfig fields of a Qwen3-MoE with every layer sparse, read from any config that
    names them the same (the run config's `model`, `EngineBenchConfig`); {} when num_experts = 0."""
    if not m.num_experts:
        return {}
    return dict(
        model_type="qwen3_moe",
        num_experts=m.num_experts,
        num_experts_per_tok=m.num_experts_per_tok,
        moe_intermediate_size=m.moe_intermediate_size,
        norm_topk_prob=m.norm_topk_prob,
        moe_dispatch=m.moe_dispatch,
    )


def _as_eos(value):
    if value is None or isinstance(value, int):
        return value
    return tuple(value)


def _moe_from_hf(hf: dict, source: str) -> dict:
    """The ModelConfig fields of a HF qwen3_moe config (transformers writes the expert count as
    `num_local_experts`, the Hub's configs as `num_experts`)."""
    if hf.get("shared_expert_intermediate_size"):
        raise ValueError(
            f"{source}: shared_expert_intermediate_size={hf['shared_expert_intermediate_size']} "
            "(shared experts) is not supported for qwen3_moe; expected 0 or absent"
        )
    num_experts = hf.get("num_experts", hf.get("num_local_experts"))
    if num_experts is None:
        raise ValueError(f"{source}: required field 'num_experts' (or 'num_local_experts') is missing")
    for key in ("num_experts_per_tok", "moe_intermediate_size"):
        if key not in hf:
            raise ValueError(f"{source}: required field {key!r} is missing")
    return dict(
        num_experts=int(num_experts),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
    )


def _rope_from_hf(hf: dict, source: str) -> RopeConfig:
    params = dict(hf.get("rope_scaling") or {})
    params.update(hf.get("rope_parameters") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind != "llama3":
        raise ValueError(f"{source}: rope type {kind!r} is not supported; expected 'default' or 'llama3'")
    try:
        return RopeConfig(
            theta=theta,
            kind="llama3",
            factor=params["factor"],
            low_freq_factor=params["low_freq_factor"],
            high_freq_factor=params["high_freq_factor"],
            original_max_position_embeddings=params["original_max_position_embeddings"],
        )
    except KeyError as err:
        raise ValueError(f"{source}: llama3 rope scaling is missing field {err.args[0]!r}") from None


def dtype_from_name(name: str):
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} not supported; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def _dtype_name(dtype) -> str:
    for name, value in _DTYPES.items():
        if jnp.dtype(value) == jnp.dtype(dtype):
            return name
    raise ValueError(f"dtype {dtype} has no HF name")
