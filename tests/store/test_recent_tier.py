"""The trainer's store: every version written through to the tensorstore tier (what the rollout
slices and a restart read), the newest ones also read back from this process's memory (the
behaviour recompute), never from disk."""

import jax
import numpy as np
import pytest

from dora_jax.parallel import sharding
from dora_jax.store import ParamStore, TensorStoreTier
from dora_jax.store.recent import RecentTier


class CountingTier(TensorStoreTier):
    def __init__(self, root):
        super().__init__(root)
        self.reads = []

    def read(self, version, shardings, *, copy=True):
        self.reads.append(version)
        return super().read(version, shardings, copy=copy)


def _params(mesh, v):
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    tree = {"w": np.arange(32, dtype=np.float32).reshape(8, 4) + v, "b": {"x": np.full((8,), v, np.float32)}}
    return jax.device_put(tree, {"w": sh, "b": {"x": sh}}), {"w": sh, "b": {"x": sh}}


def test_recent_versions_are_read_from_memory_and_every_version_is_durable(tmp_path):
    mesh = sharding.make_mesh(jax.devices()[:4], {"fsdp": 4})
    durable = CountingTier(tmp_path / "versions")
    store = ParamStore(RecentTier(durable, keep=2))
    for v in range(4):
        params, shardings = _params(mesh, v)
        store.publish(v, params)
    for v in (2, 3):  # the newest two: memory (3 on device, 2 offloaded to host)
        got = store.get(v, shardings, copy=False)
        np.testing.assert_array_equal(np.asarray(got["w"]), np.arange(32).reshape(8, 4) + v)
        assert got["w"].sharding.is_equivalent_to(shardings["w"], 2)
    assert durable.reads == []
    np.testing.assert_array_equal(np.asarray(store.get(1, shardings)["b"]["x"]), np.full((8,), 1))
    assert durable.reads == [1]  # older than `keep`: from the durable tier
    memory = store.bytes_by_tier()
    assert memory["memory_device"] == memory["memory_host"] == 32 * 4 + 8 * 4
    # another process (a fresh tier on the same root) sees every version
    assert TensorStoreTier(tmp_path / "versions").versions() == (0, 1, 2, 3)
    store.retire_below(3)
    assert store.versions() == (3,) and TensorStoreTier(tmp_path / "versions").versions() == (3,)
    assert store.bytes_by_tier()["memory_host"] == 0


def test_keep_must_hold_a_version():
    with pytest.raises(ValueError, match="keep=0"):
        RecentTier(None, keep=0)
