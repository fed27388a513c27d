"""Test-wide setup, before jax is imported anywhere: 8 fake CPU devices, and one persistent XLA
compilation cache for the session (tests and the subprocesses they start compile the same
programs; the cache changes no result, only how often XLA compiles them)."""

import atexit
import os
import shutil
import tempfile

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
