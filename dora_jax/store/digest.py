"""A cheap checksum of a params tree, the same whatever its sharding or the process reading it.

Each leaf's bits are read as unsigned integers and reduced with wrapping integer sums (plain, and
weighted by position so that moved elements change it); integer addition is associative, so the
result does not depend on how the leaf is split over devices or in what order XLA reduces. The
per-leaf sums are hashed with each leaf's path, dtype and shape. Rollout slices digest what they
load and the trainer what it recomputes behaviour log-probs with; the ledger's audit checks that
both saw the same weights for every version. One fused pass over the params (HBM-bound on an
accelerator); every process of a multi-host mesh must call it, as for any computation.
"""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np

_UINT_OF_SIZE = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _leaf_sums(x: jax.Array) -> jax.Array:
    bits = jax.lax.bitcast_convert_type(x, _UINT_OF_SIZE[x.dtype.itemsize]).astype(jnp.uint32).reshape(-1)
    position = jax.lax.iota(jnp.uint32, bits.shape[0]) * jnp.uint32(2654435761) + jnp.uint32(1)
    return jnp.stack([bits.sum(dtype=jnp.uint32), (bits * position).sum(dtype=jnp.uint32)])


_tree_sums = jax.jit(lambda leaves: [_leaf_sums(x) for x in leaves])


def params_digest(params) -> str:
    """16 hex digits identifying the params' values (and tree layout, dtypes and shapes)."""
    with_paths = jax.tree_util.tree_leaves_with_path(params)
    leaves = [x for _, x in with_paths]
    for x in leaves:
        if x.dtype.itemsize not in _UINT_OF_SIZE:
            raise TypeError(f"params_digest: {x.dtype} leaves are not supported (1, 2 or 4-byte types only)")
    sums = np.asarray(jax.device_get(_tree_sums(leaves))) if leaves else np.zeros((0, 2), np.uint32)
    h = hashlib.sha256()
    for (path, x), (plain, weighted) in zip(with_paths, sums):
        h.update(f"{jax.tree_util.keystr(path)}|{x.dtype}|{tuple(x.shape)}|{int(plain)}|{int(weighted)};".encode())
    return h.hexdigest()[:16]
