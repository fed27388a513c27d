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
    """Asks XLA for `mesh.fake_cpu_devices` host devices (only the CPU platform is affected) and
    turns on JAX's persistent compilation cache; must run before the first `import jax`."""
    # Reruns skip XLA compiles (tiny models compile for longer than they train on CPU).
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.expanduser("~/.cache/dora_jax/xla"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every save step at INFO
    count = int(config.mesh.fake_cpu_devices)
    flag = f"--xla_force_host_platform_device_count={count}"
    if count > 0 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def config_as_json(config) -> dict:
    return json.loads(config.to_json_best_effort())


def config_flags(argv: list[str]) -> list[str]:
    """The --config and --config.* flags as given (to start another process on the same config)."""
    out, take_next = [], False
    for arg in argv:
        if take_next:
            out.append(arg)
            take_next = False
        elif arg == "--config" or arg.startswith("--config.") or arg.startswith("--config="):
            out.append(arg)
            take_next = "=" not in arg
    return out
