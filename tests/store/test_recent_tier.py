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
    def __init__(self, root, background_writes=False):
        super().__init__(root, background_writes=background_writes)
        self.reads = []

    def read(self, version, shardings, *, copy=True):
        self.reads.append(version)
        return super().read(version, shardings, copy=copy)


def _params(mesh, v):
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    tree = {"w": np.arange(32, dtype=np.float32).reshape(8, 4) + v, "b": {"x": np.full((8,), v, np.float32)}}
    return jax.device_put(tree, {"w": sh, "b": {"x": sh}}), {"w": sh, "b": {"x": sh}}


@pytest.mark.parametrize("background", [False, True], ids=["write_through", "background_writes"])
def test_recent_versions_are_read_from_memory_and_every_version_is_durable(tmp_path, background):
    mesh = sharding.make_mesh(jax.devices()[:4], {"fsdp": 4})
    durable = CountingTier(tmp_path / "versions", background_writes=background)
    store = ParamStore(RecentTier(durable, keep=2))
    for v in range(4):
        params, shardings = _params(mesh, v)
        store.publish(v, params)
        params["w"].delete()  # the trainer donates its buffers to the next step: the store holds its own
    assert store.versions() == (0, 1, 2, 3)
    assert durable.pending_versions() == ((3,) if background else ())
    store.flush()
    assert durable.pending_versions() == ()
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


def test_a_failed_background_write_is_raised_by_the_next_publish_naming_the_version(tmp_path, monkeypatch):
    """Storage failing under the background writer (here: its wait reports the failure, as orbax
    does for an error in its commit thread) stops the trainer at its next publish, naming the version
    that was not written, instead of going on with a version no slice can load."""
    from dora_jax.store.tensorstore_tier import TierWriteError

    mesh = sharding.make_mesh(jax.devices()[:4], {"fsdp": 4})
    durable = TensorStoreTier(tmp_path / "versions", background_writes=True)
    store = ParamStore(RecentTier(durable, keep=2))
    store.publish(0, _params(mesh, 0)[0])
    store.flush()
    store.publish(1, _params(mesh, 1)[0])

    def broken():
        raise OSError("No space left on device")

    monkeypatch.setattr(durable._background, "wait_until_finished", broken)
    with pytest.raises(TierWriteError, match=r"background write of version 1 failed \(OSError: No space left"):
        store.publish(2, _params(mesh, 2)[0])
    monkeypatch.undo()
    assert durable.pending_versions() == () and 2 not in store.versions()
