"""Test-wide setup, before jax is imported anywhere: 8 fake CPU devices, the CPU backend's code
generation at optimization level 0 (same numbers, faster compiles), and one persistent XLA
compilation cache for the session (tests and the subprocesses they start compile the same
programs; the cache changes no result, only how often XLA compiles them). Plus the gs:// tests'
fixtures: a local GCS emulator for the session (`gcs_emulator`) and a fresh directory on it
(`gcs_root`). And jax's compiled programs are dropped after each module (`_drop_compiled_programs`)."""

import atexit
import gc
import os
import re
import shutil
import tempfile
import uuid

import pytest

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# The CPU backend's LLVM passes at level 0 (the tests' programs are tiny: compiling them, not running
# them, is most of the suite's time). It changes how the CPU code is generated, not what it computes
# (no fast-math either way). The fast lane took 298 s at the default level and 243 s at 0, one run
# after the other on this 2-core machine (2026-12-07). Subprocess jobs the tests start inherit it;
# an XLA_FLAGS that sets a level keeps its own.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests compile for TPU topologies with libtpu (ahead of time, no TPU): several processes may load it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    # A cache made here is this session's alone: remove it at exit so repeated runs do not fill /tmp.
    _cache_dir = tempfile.mkdtemp(prefix="dora_jax_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
# Every program, however quick its compile: the suite's tiny engines compile dozens of programs
# of ~0.1-0.3 s each and compile them again after each module drops them (below). With jax's
# default threshold (1 s) they were never cached, with 0.3 s most were not: the fast lane took
# 314 s with 0.3 and 278 s with 0 on this 2-core machine, one run after the other.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


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


# Linux caps a process at vm.max_map_count (65,530) memory mappings, and every executable XLA
# compiles for the CPU keeps about eight (its code, constants and data) for as long as jax's caches
# hold it. One pytest process that compiles the whole suite's programs reached that cap about 80%
# of the way through, and the next compile or executable load died with SIGSEGV (the mmap LLVM
# asks for fails). Each module's programs are therefore dropped when the module ends.
MAX_MAP_COUNT_PER_MODULE = 32_000


def _memory_mappings() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


@pytest.fixture(scope="module", autouse=True)
def _drop_compiled_programs(request):
    """Clears jax's compiled programs after each test module (see MAX_MAP_COUNT_PER_MODULE), and
    fails the module after which the process holds more mappings than about half the cap
    (the module's own programs, or programs still held by objects that outlive their module)."""
    yield
    import jax  # after the environment above is set

    held = _memory_mappings()
    jax.clear_caches()
    gc.collect()
    assert held < MAX_MAP_COUNT_PER_MODULE, (
        f"the process held {held} memory mappings after {request.node.name} (Linux's cap: 65,530): "
        "drop compiled programs sooner"
    )
