"""ParamStore semantics over the in-process tier (and concurrency over both tiers)."""

import threading

import jax
import numpy as np
import pytest

from dora_jax.models import ModelConfig, init_model, logical_axes, split
from dora_jax.parallel import sharding
from dora_jax.store import InProcessTier, ParamStore, StoreError, TensorStoreTier

CFG = ModelConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
)


@pytest.fixture(scope="module")
def model_parts():
    model = init_model(CFG, seed=1)
    graphdef, params = split(model)
    axes = logical_axes(model)
    slices = sharding.split_devices({"fsdp": 2, "tensor": 2}, {"tensor": 2}, 2)
    trainer_sh = sharding.tree_shardings(axes, params, slices.trainer, sharding.TRAINER_RULES)
    rollout_sh = sharding.tree_shardings(axes, params, slices.rollout[0], sharding.ROLLOUT_RULES)
    return jax.device_put(params, trainer_sh), trainer_sh, rollout_sh


def scaled(params, factor):
    return jax.tree.map(lambda x: x * factor, params)


def assert_tree_close(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_publish_get_in_reader_shardings(model_parts):
    params, trainer_sh, rollout_sh = model_parts
    store = ParamStore(InProcessTier())
    assert store.latest() is None and store.versions() == ()
    store.publish(0, params)
    store.publish(3, scaled(params, 2.0))
    assert store.latest() == 3 and store.versions() == (0, 3)
    got = store.get(3, rollout_sh)
    assert_tree_close(got, scaled(params, 2.0))
    for leaf, want in zip(jax.tree.leaves(got), jax.tree.leaves(rollout_sh)):
        assert leaf.sharding == want
    # The store owns its copy: deleting what a reader got (or what the writer published) is safe.
    jax.tree.map(lambda x: x.delete(), got)
    assert_tree_close(store.get(0, trainer_sh), params)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    assert store.bytes_by_tier() == {"device": 2 * nbytes, "host": 0}


def test_host_offload_keeps_older_versions_readable(model_parts):
    params, trainer_sh, rollout_sh = model_parts
    store = ParamStore(InProcessTier(device_versions=1))
    for v in range(3):
        store.publish(v, scaled(params, float(v + 1)))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    assert store.bytes_by_tier() == {"device": nbytes, "host": 2 * nbytes}
    assert_tree_close(store.get(0, rollout_sh), params)
    assert_tree_close(store.get(2, trainer_sh), scaled(params, 3.0))


def test_bad_input_errors(model_parts):
    params, trainer_sh, _ = model_parts
    store = ParamStore(InProcessTier())
    store.publish(1, params)
    store.publish(2, params)
    with pytest.raises(StoreError, match=r"publish\(2\): versions must increase; the newest version is 2"):
        store.publish(2, params)
    with pytest.raises(StoreError, match=r"publish\(0\).*newest version is 2"):
        store.publish(0, params)
    with pytest.raises(StoreError, match=r"version 7 was never published; live versions: \[1, 2\]"):
        store.get(7, trainer_sh)
    assert store.retire_below(2) == (1,)
    with pytest.raises(StoreError, match=r"version 1 was retired; live versions: \[2\]"):
        store.get(1, trainer_sh)
    with pytest.raises(StoreError, match=r"publish\(1\).*newest version is 2"):
        store.publish(1, params)  # a retired version is still "seen"
    with pytest.raises(StoreError, match=r"unpin\(2\): version 2 is not pinned"):
        store.unpin(2)
    with pytest.raises(StoreError, match=r"version 1 was retired"):
        store.pin(1)


def test_pinned_versions_survive_retire_below(model_parts):
    params, trainer_sh, _ = model_parts
    store = ParamStore(InProcessTier())
    for v in range(4):
        store.publish(v, scaled(params, float(v + 1)))
    store.pin(1)
    store.pin(1)
    assert store.retire_below(3) == (0, 2)
    assert store.versions() == (1, 3)
    assert store.pins() == {1: 2}
    assert_tree_close(store.get(1, trainer_sh), scaled(params, 2.0))
    store.unpin(1)
    assert store.versions() == (1, 3)  # still one holder
    store.unpin(1)
    assert store.versions() == (3,)  # freed by its last unpin: it was below the watermark
    assert store.retire_below(10) == ()  # the newest version is never retired
    assert store.versions() == (3,)


def test_rollback_to_for_resume(model_parts):
    params, trainer_sh, _ = model_parts
    store = ParamStore(InProcessTier())
    for v in range(5):
        store.publish(v, scaled(params, float(v + 1)))
    store.retire_below(1)
    store.pin(4)
    with pytest.raises(StoreError, match=r"rollback_to\(2\): versions \[4\] are pinned"):
        store.rollback_to(2)
    store.unpin(4)
    assert store.rollback_to(2) == (3, 4)
    assert store.versions() == (1, 2)
    store.publish(3, scaled(params, 10.0))  # the resumed trainer publishes 3 again
    assert_tree_close(store.get(3, trainer_sh, copy=False), scaled(params, 10.0))


def _hammer(store, params, read_shardings, num_versions):
    """One writer publishes params * v for v = 1..n; readers must always see one whole version."""
    base = [np.asarray(x) for x in jax.tree.leaves(params)]
    errors, seen = [], set()
    done = threading.Event()

    def reader():
        try:
            while not done.is_set():
                v = store.latest()
                if v is None:
                    continue
                try:
                    got = store.get(v, read_shardings)
                except StoreError as err:  # retired between latest() and get(): allowed
                    assert "was retired" in str(err)
                    continue
                for leaf, want in zip(jax.tree.leaves(got), base):
                    np.testing.assert_array_equal(np.asarray(leaf), want * v)
                seen.add(v)
        except Exception as err:  # noqa: BLE001 - surfaced below
            errors.append(err)

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for v in range(1, num_versions + 1):
            store.publish(v, scaled(params, float(v)))
            store.retire_below(v - 1)
    finally:
        done.set()
        for t in threads:
            t.join()
    assert not errors, errors[0]
    assert seen, "the readers never got a version"


@pytest.mark.parametrize("tier_kind", ["in_process", "tensorstore"])
def test_concurrent_publish_and_get(model_parts, tier_kind, tmp_path):
    params, trainer_sh, rollout_sh = model_parts
    tier = InProcessTier(device_versions=2) if tier_kind == "in_process" else TensorStoreTier(tmp_path / "store")
    store = ParamStore(tier)
    num_versions = 12 if tier_kind == "in_process" else 5
    _hammer(store, params, rollout_sh, num_versions)
    assert store.versions() == (num_versions - 1, num_versions)
