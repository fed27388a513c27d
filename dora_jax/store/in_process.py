"""The in-process tier: versions held as arrays in this process (the embedded default).

`write` copies the writer's arrays (the trainer donates its state buffers to the next step, so the
store must own its own) and `read` is one `jax.device_put` to the reader's shardings, again a copy
so that a reader may donate what it gets (`copy=False`: aliases the stored buffers where the
layout already matches). With `device_versions=n` only the newest n versions stay
on device; older ones are offloaded to host memory (numpy) and put back on a device when read.
"""

from __future__ import annotations

import threading

import jax
import numpy as np

from dora_jax.store.param_store import Params, Shardings


def tree_bytes(tree) -> int:
    return int(sum(leaf.nbytes for leaf in jax.tree.leaves(tree)))


def _owned_copy(x):
    if isinstance(x, jax.Array):
        return jax.device_put(x, x.sharding, may_alias=False)
    return jax.device_put(np.array(x))  # host data: onto the default device


class InProcessTier:
    """Versions as device arrays (newest `device_versions`) or host numpy arrays (older)."""

    def __init__(self, device_versions: int | None = None):
        if device_versions is not None and device_versions < 1:
            raise ValueError(f"device_versions={device_versions}; expected None (all on device) or >= 1")
        self._device_versions = device_versions
        self._lock = threading.Lock()
        # jax's resharding of one stored array from several threads at once is not safe (a reader saw
        # 3 of an array's 4 shards while others resharded it: tests/store/test_param_store.py's
        # concurrent test, under load), so copies out of the stored trees are made one at a time.
        self._copy_lock = threading.Lock()
        self._on_device: dict[int, Params] = {}
        self._on_host: dict[int, Params] = {}

    def write(self, version: int, params: Params) -> None:
        owned = jax.tree.map(_owned_copy, params)
        jax.block_until_ready(owned)
        with self._lock:
            self._on_device[version] = owned
            offload = []
            if self._device_versions is not None:
                offload = sorted(self._on_device)[: -self._device_versions]
            moved = {v: self._on_device[v] for v in offload}
        # Device-to-host copies outside the dict lock (one at a time with the readers' copies);
        # readers of these versions still see device copies.
        with self._copy_lock:
            moved = {v: jax.tree.map(np.asarray, tree) for v, tree in moved.items()}
        with self._lock:
            for v, host_tree in moved.items():
                if v in self._on_device:  # not deleted meanwhile
                    self._on_host[v] = host_tree
                    del self._on_device[v]

    def read(self, version: int, shardings: Shardings, *, copy: bool = True) -> Params:
        with self._lock:
            tree = self._on_device.get(version)
            if tree is None:
                tree = self._on_host.get(version)
        if tree is None:
            raise KeyError(f"in-process tier holds no version {version}")
        with self._copy_lock:
            return jax.device_put(tree, shardings, may_alias=False if copy else None)

    def stored(self, version: int) -> Params:
        """The tier's own copy of `version` (device or host arrays), not a copy of it: for a
        caller that only reads it (a durable write of the same version)."""
        with self._lock:
            tree = self._on_device.get(version, self._on_host.get(version))
        if tree is None:
            raise KeyError(f"in-process tier holds no version {version}")
        return tree

    def delete(self, version: int) -> None:
        with self._lock:
            self._on_device.pop(version, None)
            self._on_host.pop(version, None)

    def versions(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(sorted(self._on_device.keys() | self._on_host.keys()))

    def bytes_by_tier(self) -> dict[str, int]:
        with self._lock:
            return {
                "device": sum(tree_bytes(t) for t in self._on_device.values()),
                "host": sum(tree_bytes(t) for t in self._on_host.values()),
            }
