"""What the three role processes share: their flags, the config identity, multi-host start-up.

Roles: `python -m dora_jax.serve_coordinator`, `python -m dora_jax.trainer_worker`,
`python -m dora_jax.rollout_worker`. Every role parses the same `--config` (and overrides); the
digest of the resolved config is the run's identity, and the coordinator refuses a client whose
digest or package version differs. Nothing here imports JAX: the roles set up devices first.
"""

from __future__ import annotations

import os
import sys

from absl import flags

from dora_jax import cli
from dora_jax.transport.client import ClientTiming, config_hash

COORDINATOR = flags.DEFINE_string("coordinator", None, "HOST:PORT of `python -m dora_jax.serve_coordinator`")
VERSIONS = flags.DEFINE_string("versions", "", "root of the ParamStore's tensorstore tier shared by the trainer "
                               "and rollout processes (a path or gs://...); default WORKDIR/versions")
CONNECT_TIMEOUT_S = flags.DEFINE_float("connect_timeout_s", 300.0,
                                       "exit with an error once the coordinator has not answered for this long")
CALL_TIMEOUT_S = flags.DEFINE_float("call_timeout_s", 30.0, "deadline of one call to the coordinator")
NUM_HOSTS = flags.DEFINE_integer("num_hosts", 1, "hosts in this role's slice (> 1: jax.distributed.initialize)")
HOST_ID = flags.DEFINE_integer("host_id", 0, "this host's index in its slice (0 talks to the coordinator)")
JAX_COORDINATOR = flags.DEFINE_string("jax_coordinator", "", "HOST:PORT of the slice's host 0 for "
                                      "jax.distributed.initialize; empty = auto-detect (Cloud TPU)")


def quiet_library_logs() -> None:
    """Orbax logs every save and restore at INFO; a role's log keeps warnings and its own lines."""
    from absl import logging

    logging.set_verbosity(logging.WARNING)


def config_json() -> dict:
    return cli.config_as_json(cli.CONFIG.value)


def identity_hash() -> str:
    return config_hash(config_json())


def require(flag, name: str):
    if not flag.value and flag.value != 0:
        raise SystemExit(f"--{name} is required")
    return flag.value


def versions_root(workdir: str) -> str:
    return VERSIONS.value or os.path.join(workdir, "versions")


def client_timing() -> ClientTiming:
    return ClientTiming(call_timeout_s=CALL_TIMEOUT_S.value, unreachable_after_s=CONNECT_TIMEOUT_S.value)


def initialize_distributed(role: str) -> None:
    """A slice spanning several hosts is one multi-controller JAX job: `jax.distributed.initialize`
    inside the slice (never across slices; never on CPU). Call before any other JAX use.

    Trainer: every host registers, takes the same batch (TakeBatch is idempotent per trainer
    version) and reports the same publish; host 0 alone retires versions and writes metrics.
    Rollout: a multi-host rollout slice would need host 0's command sequence mirrored to the
    other hosts; that is not built, so it is refused.
    """
    num_hosts, host_id = NUM_HOSTS.value, HOST_ID.value
    if num_hosts < 1 or not 0 <= host_id < num_hosts:
        raise SystemExit(f"--num_hosts={num_hosts} --host_id={host_id}; expected 0 <= host_id < num_hosts")
    if num_hosts == 1:
        return
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        raise SystemExit(f"--num_hosts={num_hosts} on the CPU platform: multi-host slices are for accelerators")
    if role == "rollout":
        raise SystemExit(f"--num_hosts={num_hosts}: multi-host rollout slices are not supported yet; "
                         "give each rollout slice one host (rollout.num_slices counts them)")
    import jax

    jax.distributed.initialize(coordinator_address=JAX_COORDINATOR.value or None,
                               num_processes=num_hosts, process_id=host_id)


def fail(message: str, code: int = 1):
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)
