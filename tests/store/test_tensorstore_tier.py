"""The tensorstore tier across processes: another mesh reads a version; a killed writer leaves nothing half-visible."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from dora_jax.models import ModelConfig, init_model, logical_axes, split
from dora_jax.parallel import sharding
from dora_jax.store import ParamStore, StoreError, TensorStoreTier, version_dir_name

CFG = ModelConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
)
SCRIPT = Path(__file__).with_name("store_process.py")
REPO = Path(__file__).resolve().parents[2]


def _child_env():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the child sets its own device count
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """Versions 0..2 of a tiny model, written from an fsdp=4 x tensor=2 trainer mesh."""
    root = tmp_path_factory.mktemp("ts") / "store"
    model = init_model(CFG, seed=5)
    _, params = split(model)
    axes = logical_axes(model)
    mesh = sharding.make_mesh(jax.devices(), {"fsdp": 4, "tensor": 2})
    trainer_sh = sharding.tree_shardings(axes, params, mesh, sharding.TRAINER_RULES)
    params = jax.device_put(params, trainer_sh)
    store = ParamStore(TensorStoreTier(root))
    for v in range(3):
        store.publish(v, jax.tree.map(lambda x, v=v: x + v, params))
    return root, store, params, trainer_sh


def test_same_process_roundtrip_and_bytes(published):
    root, store, params, trainer_sh = published
    assert store.versions() == (0, 1, 2)
    got = store.get(1, trainer_sh)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y) + 1)
        assert x.sharding == y.sharding
    on_disk = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    assert store.bytes_by_tier() == {"tensorstore": on_disk}
    assert sorted(p.name for p in root.iterdir()) == [version_dir_name(v) for v in range(3)]


def test_a_reader_scanning_while_the_writer_retires_a_version_skips_it(published, monkeypatch):
    """A reader lists the root while the trainer retires a version: the directory it is sizing
    disappears under it. The reader must see the version gone, not fail (a rollout slice's load
    failed on exactly this after a trainer's resume)."""
    from dora_jax.store import tensorstore_tier

    root = published[0]
    sizing = tensorstore_tier._dir_bytes

    def vanishing(path):
        if path.name == version_dir_name(1):
            raise FileNotFoundError(f"No such file or directory: {path}")
        return sizing(path)

    monkeypatch.setattr(tensorstore_tier, "_dir_bytes", vanishing)
    assert TensorStoreTier(root, read_only=True).versions() == (0, 2)


@pytest.mark.slow
def test_another_process_reads_with_its_own_mesh(published, tmp_path):
    root, store, params, _ = published
    out = tmp_path / "got.npz"
    subprocess.run(
        [sys.executable, str(SCRIPT), "read", str(root), "2", str(out)],
        env=_child_env(),
        check=True,
        timeout=120,
        capture_output=True,
    )
    got = np.load(out)
    assert list(got["versions"]) == [0, 1, 2]
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        key = jax.tree_util.keystr(path)
        np.testing.assert_array_equal(got[key], np.asarray(leaf) + 2)
    # The reader used rollout rules: embed whole, mlp over tensor.
    assert str(got["['layers'][0]['mlp']['gate_EM']:spec"]) == "P(None, 'tensor')"


@pytest.mark.slow
def test_writer_killed_mid_write_leaves_no_partial_version(tmp_path):
    root = tmp_path / "store"
    child = subprocess.Popen(
        [sys.executable, str(SCRIPT), "write", str(root), "64"],
        env=_child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "published 1"
        assert child.stdout.readline().strip() == "writing 2"
        deadline = time.monotonic() + 60
        while not any(".orbax-checkpoint-tmp" in p.name for p in root.iterdir()):  # mid-write
            assert time.monotonic() < deadline and child.poll() is None, "never caught the write in flight"
            time.sleep(0.002)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert any(".orbax-checkpoint-tmp" in p.name for p in root.iterdir())

    reader = ParamStore(TensorStoreTier(root, read_only=True))
    assert reader.versions() == (1,) and reader.latest() == 1
    mesh = sharding.make_mesh(jax.devices()[:1], {})
    replicated = {"w": sharding.replicated(mesh)}
    with pytest.raises(StoreError, match=r"version 2 was never published; live versions: \[1\]"):
        reader.get(2, replicated)
    np.testing.assert_array_equal(np.asarray(reader.get(1, replicated)["w"]), np.ones(1024))

    # A new writer clears the leftovers and can publish version 2 for real.
    writer = ParamStore(TensorStoreTier(root))
    assert sorted(p.name for p in root.iterdir()) == [version_dir_name(1)]
    writer.publish(2, {"w": jax.numpy.full((1024,), 2.0)})
    assert reader.versions() == (1, 2)
    np.testing.assert_array_equal(np.asarray(reader.get(2, replicated)["w"]), np.full(1024, 2.0))


def test_versions_on_gcs_save_load_and_show_up_in_a_reader(gcs_root):
    """gs:// through a local GCS emulator: tensorstore writes the arrays (pointed there by
    dora_jax.core.fs), orbax's epath the metadata (through gcsfs)."""
    root = f"{gcs_root}/versions"
    mesh = sharding.make_mesh(jax.devices()[:4], {"fsdp": 2, "tensor": 2})
    spec = {"w": jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp", "tensor"))}
    params = {"w": jax.device_put(np.arange(64.0, dtype=np.float32).reshape(8, 8), spec["w"])}
    writer = ParamStore(TensorStoreTier(root))
    writer.publish(0, params)
    reader = ParamStore(TensorStoreTier(root, read_only=True))
    assert reader.versions() == (0,)
    writer.publish(1, jax.tree.map(lambda x: x + 1, params))
    assert reader.versions() == (0, 1)  # a new listing each time: nothing cached
    other = {"w": sharding.replicated(sharding.make_mesh(jax.devices()[4:5], {}))}
    got = reader.get(1, other)
    np.testing.assert_array_equal(np.asarray(got["w"]), np.arange(64.0).reshape(8, 8) + 1)
    assert got["w"].sharding == other["w"]
    assert writer.bytes_by_tier()["tensorstore"] > 64 * 4 * 2 * 0.1
    writer.rollback_to(0)
    assert writer.versions() == (0,) and reader.versions() == (0,)
    with pytest.raises(OSError, match="gs://no-such-bucket/versions: bucket gs://no-such-bucket does not exist"):
        TensorStoreTier("gs://no-such-bucket/versions")
