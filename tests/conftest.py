"""Test-wide setup, before jax is imported anywhere: 8 fake CPU devices, and one persistent XLA
compilation cache for the session (tests and the subprocesses they start compile the same
programs; the cache changes no result, only how often XLA compiles them)."""

import os
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="dora_jax_xla_cache_"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")
