"""Shared flag handling for the entry points: the config file, the workdir, and the device set-up
that must happen before JAX is imported (fake CPU devices for the embedded CPU run)."""

from __future__ import annotations

import json
import os

from absl import flags
from ml_collections import config_flags

CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file (configs/*.py)", lock_config=True)
WORKDIR = flags.DEFINE_string("workdir", None, "run directory (ledger, metrics, checkpoints)")
# Flags that several entry points take under one name are defined once here (absl refuses a name
# defined by two modules of one process); each entry point reads them with its own default.
PORT = flags.DEFINE_integer(
    "port", None, "coordinator port (serve_coordinator: default 50051; launch_local: default a free one)"
)
TIMEOUT_S = flags.DEFINE_float(
    "timeout_s", None, "give up and stop every role after this long (default 7200; chaos: per process, 1800)"
)

MAX_RESTARTS = flags.DEFINE_integer(
    "max_restarts",
    None,
    "start a dead role again, this many times in all (launch_local: default 0; launch_ray: Ray's "
    "max_restarts of each role's actor, default 3); the run resumes from its checkpoint and snapshot",
)
TRACE_LENGTHS = flags.DEFINE_bool(
    "trace_lengths",
    False,
    "a trace-driven run (what `bench modes` launches): every request stops at a length drawn from "
    "config.bench (median_len, sigma, max_len; keyed by prompt and sample) and every sample scores 0",
)
OUT = flags.DEFINE_string("out", None, "output directory (bench: JSON results and plots; tpu_compile: compile.json)")


def flag_or(holder, default):
    """The flag's value, or `default` when it was not given."""
    return default if holder.value is None else holder.value


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
