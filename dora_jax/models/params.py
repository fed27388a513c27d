"""How model code makes parameters: an `nnx.Param` named by logical axes, and its random init."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def param(value, names: tuple[str | None, ...]) -> nnx.Param:
    """A parameter whose dimensions carry logical axis `names` (None: never sharded).

    eager_sharding=False: the names are metadata only; placement happens in dora_jax.parallel.sharding.
    """
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def normal(rngs: nnx.Rngs, shape, dtype, std=0.02):
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
