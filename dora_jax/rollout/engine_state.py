"""The rollout engine's device state: one request after prefill (`Prefix`), every decode slot
(`DecodeState`: the pure pytree `generate` transforms) and a step's tokens (`ResultTokens`).

Shape letters: B decode slots, R prefix rows, S cache rows per slot, L layers, K kv heads,
D head_dim.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dora_jax.models import KVCache, ModelConfig, paged
from dora_jax.parallel import sharding as sharding_lib

PREFIX_KV_AXES = ("layers", "length", "kv_heads", "head_dim")  # a Prefix's k_LRKD / v_LRKD


@flax.struct.dataclass
class Prefix:
    """One request after prefill: KV rows 0..length-1 valid, `token` pending (not yet fed)."""

    k_LRKD: jax.Array
    v_LRKD: jax.Array
    length: jax.Array  # int32: valid rows = position where `token` will be written
    token: jax.Array  # int32
    logp: jax.Array  # float32: log-prob of `token` at the temperature, unfiltered (0 when it was not sampled)
    key_data: jax.Array  # uint32[2]: the slot's base sampling key
    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    generated: jax.Array  # int32: tokens this engine has sampled for the request


@flax.struct.dataclass
class DecodeState:
    """Every slot's state; the only thing `generate` transforms."""

    cache: KVCache | tuple  # k_LBSKD / v_LBSKD, or the paged pool (one [P, N, C, D] array per layer)
    position_B: jax.Array  # row where each slot's pending token goes
    token_B: jax.Array  # pending token (the last sampled one)
    generated_B: jax.Array
    key_data_B2: jax.Array
    temperature_B: jax.Array
    top_p_B: jax.Array
    top_k_B: jax.Array


@flax.struct.dataclass
class ResultTokens:
    """JetStream's ResultTokens layout (`data` = [token | valid | length] per slot) plus log-probs."""

    data: jax.Array  # [B, 3] int32
    log_prob: jax.Array  # [B, 1] log-prob of each token at its temperature, unfiltered (sampling.sample)
    sample_log_prob: jax.Array  # [B, 1] log-prob under the sampling distribution
    tokens_idx: tuple[int, int] = flax.struct.field(pytree_node=False, default=(0, 1))
    valid_idx: tuple[int, int] = flax.struct.field(pytree_node=False, default=(1, 2))
    length_idx: tuple[int, int] = flax.struct.field(pytree_node=False, default=(2, 3))
    samples_per_slot: int = flax.struct.field(pytree_node=False, default=1)

    def copy_to_host_async(self) -> None:
        for array in (self.data, self.log_prob, self.sample_log_prob):
            if isinstance(array, jax.Array):
                array.copy_to_host_async()

    def convert_to_numpy(self) -> ResultTokens:
        return jax.tree.map(np.asarray, jax.device_get(self))


def empty_prefix(model_config: ModelConfig, rows: int) -> Prefix:
    """A Prefix of `rows` zero rows on host (warmup's and lowering's stand-in, a shared prefix's frame)."""
    kv = np.zeros(
        (model_config.num_layers, rows, model_config.num_kv_heads, model_config.head_dim), jnp.dtype(model_config.dtype)
    )
    return Prefix(
        kv,
        kv,
        np.int32(0),
        np.int32(0),
        np.float32(0),
        np.zeros((2,), np.uint32),
        np.float32(0),
        np.float32(1),
        np.int32(0),
        np.int32(0),
    )


def with_host_length(prefix: Prefix, length: int) -> Prefix:
    """`prefix` carrying its length as the host knows it, so that a paged insert need not wait for
    the device (`host_length` reads it back)."""
    object.__setattr__(prefix, "_host_length", length)
    return prefix


def host_length(prefix: Prefix) -> int:
    """The prefix's valid rows: as the host knows them, or read from this host's copy (one sync)."""
    known = getattr(prefix, "_host_length", None)
    if known is not None:
        return known
    length = prefix.length  # a Prefix built elsewhere: read this host's copy (one sync)
    return int(length.addressable_data(0) if isinstance(length, jax.Array) else length)


def _combined(mesh: Mesh) -> bool:
    """A paged pool in the TPU kernel's combined layout on TPU, split into keys and values elsewhere."""
    return mesh.devices.flat[0].platform == "tpu"


def pool_pack(model_config: ModelConfig, mesh: Mesh, rules) -> int:
    """0: a split pool (not TPU); else kv heads per row of the combined pool (`paged.lane_pack`,
    each device's share of the heads whole)."""
    if not _combined(mesh):
        return 0
    K = model_config.num_kv_heads
    spec = sharding_lib.logical_to_spec(("kv_heads",), (K,), mesh, rules)[0]
    axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
    return paged.lane_pack(K, model_config.head_dim, int(np.prod([mesh.shape[a] for a in axes], dtype=int)))
