"""Shared flag handling for the entry points: the config file, the workdir, and the device set-up
that must happen before JAX is imported (fake CPU devices for the embedded CPU run)."""

from __future__ import annotations

import json
import os

from absl import flags
from ml_collections import config_flags

CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file (configs/*.py)", lock_config=True)
WORKDIR = flags.DEFINE_string("workdir", None, "run directory (ledger, metrics, checkpoints)")


def prepare_devices(config) -> None:
    """Asks XLA for `mesh.fake_cpu_devices` host devices (only the CPU platform is affected);
    must run before the first `import jax`."""
    count = int(config.mesh.fake_cpu_devices)
    flag = f"--xla_force_host_platform_device_count={count}"
    if count > 0 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def config_as_json(config) -> dict:
    return json.loads(config.to_json_best_effort())
