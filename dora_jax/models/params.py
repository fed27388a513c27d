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


def in_compute_dtype(params, dtype):
    """`params` with every floating leaf cast to the compute `dtype` (what each block casts it to
    before use, so no number changes): the form versions are published and served in, half the
    bytes of fp32 master weights when computing in bf16. Leaves already in `dtype` are kept."""
    dtype = jnp.dtype(dtype)
    cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype else x  # noqa: E731
    return jax.tree.map(cast, params)


def served_abstract(abstract_params, shardings, dtype):
    """ShapeDtypeStructs of params as a version is served: laid out as `shardings`, the floating
    leaves in the compute `dtype` (what a device-to-device pull asks for)."""
    dtype = jnp.dtype(dtype)

    def served(x, s):
        return jax.ShapeDtypeStruct(x.shape, dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype, sharding=s)

    return jax.tree.map(served, abstract_params, shardings)
