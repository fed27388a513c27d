"""Test-wide setup, before jax is imported anywhere: 8 fake CPU devices, and one persistent XLA
compilation cache for the session (tests and the subprocesses they start compile the same
programs; the cache changes no result, only how often XLA compiles them). Plus the gs:// tests'
fixtures: a local GCS emulator for the session (`gcs_emulator`) and a fresh directory on it
(`gcs_root`)."""

import atexit
import os
import re
import shutil
import tempfile
import uuid

import pytest

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests compile for TPU topologies with libtpu (ahead of time, no TPU): several processes may load it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    # A cache made here is this session's alone: remove it at exit so repeated runs do not fill /tmp.
    _cache_dir = tempfile.mkdtemp(prefix="dora_jax_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")


@pytest.fixture(scope="session")
def gcs_emulator():
    """A local GCS (tests/gcs_emulator.py) for the session, STORAGE_EMULATOR_HOST pointing at it."""
    from tests import gcs_emulator  # needs gcp-storage-emulator (the `test` extra): a missing one fails, never skips

    with gcs_emulator.running() as emulator:
        yield emulator


@pytest.fixture
def gcs_root(gcs_emulator, request):
    """A fresh gs:// directory on the emulator's bucket, named after the test."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)[:60]
    return f"gs://{gcs_emulator.bucket}/{name}-{uuid.uuid4().hex[:8]}"


# Modules whose tests load libtpu into the pytest process (AOT compiles for TPU topologies).
LIBTPU_MODULES = ("test_tpu_compile.py",)


def pytest_collection_modifyitems(config, items):
    """The TPU compile tests run last, after every other module's. Three full runs of the suite
    crashed the pytest process inside XLA's CPU compile or executable load, each time in
    tests/test_train_smoke.py's embedded runs, which came after these tests had loaded libtpu (its
    own copy of XLA's compiler) into this process; subsets of the suite never did. Suspected,
    not proven."""
    items.sort(key=lambda item: item.path.name in LIBTPU_MODULES)  # stable: the order is kept otherwise
