"""The decoder family (dense and Qwen3-MoE), its KV cache, HF checkpoint I/O and tokenizers.

Params travel through the system as a pure nested dict of arrays (`split`), with a matching
tree of logical axis names (`logical_axes`); `nnx.merge(graphdef, params)` rebuilds the module
inside jitted code.
"""

from __future__ import annotations

from flax import nnx

from dora_jax.models.config import COMPUTE_FIELDS, ModelConfig, RopeConfig, dtype_from_name, moe_fields
from dora_jax.models.decoder import KV_CACHE_AXES, Decoder, KVCache, init_model
from dora_jax.models.hf_io import load_hf, read_config, save_hf
from dora_jax.models.moe import Routing, expert_load, load_balancing_loss
from dora_jax.models.paged import PAGED_KV_AXES, PagedKVCache
from dora_jax.models.params import in_compute_dtype, served_abstract


def split(model: Decoder):
    """(graphdef, params) with params a pure dict of arrays."""
    graphdef, state = nnx.split(model, nnx.Param)
    return graphdef, nnx.to_pure_dict(state)


def logical_axes(model: Decoder):
    """A tree like `split(model)[1]` with a PartitionSpec of logical names per leaf."""
    return nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model, nnx.Param)))


def abstract_model(config: ModelConfig) -> Decoder:
    """The decoder with ShapeDtypeStructs instead of arrays (no memory)."""
    return nnx.eval_shape(lambda: init_model(config))


__all__ = [
    "COMPUTE_FIELDS",
    "KV_CACHE_AXES",
    "Decoder",
    "KVCache",
    "PAGED_KV_AXES",
    "PagedKVCache",
    "ModelConfig",
    "RopeConfig",
    "Routing",
    "abstract_model",
    "dtype_from_name",
    "expert_load",
    "in_compute_dtype",
    "served_abstract",
    "init_model",
    "load_balancing_loss",
    "load_hf",
    "logical_axes",
    "moe_fields",
    "read_config",
    "save_hf",
    "split",
]
