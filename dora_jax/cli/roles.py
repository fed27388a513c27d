"""What the three role processes share: their flags, the config identity, multi-host start-up.

Roles: `python -m dora_jax.serve_coordinator`, `python -m dora_jax.trainer_worker`,
`python -m dora_jax.rollout_worker`. Every role parses the same `--config` (and overrides); the
digest of the resolved config is the run's identity, and the coordinator refuses a client whose
digest or package version differs. Nothing here imports JAX: the roles set up devices first.

Authentication is always on between role processes: the coordinator reads the run secret, the
trainer and each rollout slice their own role token, from the files the launcher made
(dora_jax/transport/auth.py names the variables; docs/security.md tells the whole story).
"""

from __future__ import annotations

import logging
import os
import sys

from absl import flags

from dora_jax import cli
from dora_jax.core import fs
from dora_jax.transport import auth
from dora_jax.transport.client import ClientTiming, config_hash

COORDINATOR = flags.DEFINE_string("coordinator", None, "HOST:PORT of `python -m dora_jax.serve_coordinator`")
VERSIONS = flags.DEFINE_string(
    "versions",
    "",
    "root of the ParamStore's tensorstore tier shared by the trainer "
    "and rollout processes (a path or gs://...); default WORKDIR/versions",
)
CONNECT_TIMEOUT_S = flags.DEFINE_float(
    "connect_timeout_s", 300.0, "exit with an error once the coordinator has not answered for this long"
)
TRANSFER_HOST = flags.DEFINE_string(
    "transfer_host",
    "",
    "address this process's JAX transfer servers (weights, KV migration) listen on; empty: this host's own "
    "address (its name's, the VM's internal address on Cloud TPU). launch_local passes 127.0.0.1",
)
TRANSFER_PORT = flags.DEFINE_integer(
    "transfer_port",
    0,
    "control port of this process's transfer server (its bulk port is the next one); 0: any free ports. "
    "A pod passes pod.transfer_port, which its firewall rule opens between the run's VMs",
)
CALL_TIMEOUT_S = flags.DEFINE_float("call_timeout_s", 30.0, "deadline of one call to the coordinator")
NUM_HOSTS = flags.DEFINE_integer(
    "num_hosts",
    1,
    "hosts in this role's slice (> 1: the slice is one multi-controller "
    "JAX job, jax.distributed.initialize over its own hosts)",
)
HOST_ID = flags.DEFINE_integer(
    "host_id",
    None,
    "this host's index in its slice, 0..num_hosts-1 (host 0 alone talks "
    "to the coordinator); default: 0 on one host, auto-detected on Cloud TPU",
)
JAX_COORDINATOR = flags.DEFINE_string(
    "jax_coordinator",
    "",
    "HOST:PORT where host 0 of this slice serves "
    "jax.distributed (each slice its own); empty = auto-detect (Cloud TPU only)",
)


def log_as(role: str) -> None:
    """This process's own lines (the `dora_jax` loggers, INFO and up) go to stderr as `[role]
    message`, one per line, as the launchers' log files expect; libraries keep their warnings
    (`quiet_library_logs`)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[{role}] %(message)s"))
    logger = logging.getLogger("dora_jax")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False


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
    return VERSIONS.value or fs.join(workdir, "versions")


def client_timing() -> ClientTiming:
    return ClientTiming(call_timeout_s=CALL_TIMEOUT_S.value, unreachable_after_s=CONNECT_TIMEOUT_S.value)


def client_credentials() -> auth.ClientCredentials:
    """This role's token (and the run's CA with TLS), from the variables the launcher set; exits
    naming them when they are missing."""
    try:
        return auth.client_credentials(os.environ)
    except (ValueError, OSError) as err:
        fail(f"cannot authenticate to the coordinator: {err}")


def transfer_host() -> str | None:
    return TRANSFER_HOST.value or None


def transfer_port() -> int:
    return TRANSFER_PORT.value


def initialize_distributed(role: str) -> int:
    """Joins this process to its slice's multi-controller JAX job when the slice has more than one
    host (`jax.distributed.initialize` over the slice's own hosts: never across slices); returns
    this host's index in the slice. Call before any other JAX use.

    On Cloud TPU the hosts and their indices are auto-detected; on CPU (tests, `launch_local
    --hosts_per_slice`) `--jax_coordinator` and `--host_id` are required and collectives go over
    gloo. Trainer: every host registers, takes the same batch (TakeBatch is idempotent per trainer
    version), runs the same step and reports the same publish; host 0 alone retires versions and
    writes metrics. Rollout: host 0 serves the coordinator and mirrors every engine call to the
    other hosts (dora_jax/transport/host_mirror.py).
    """
    del role  # both roles join the same way
    num_hosts, host_id = NUM_HOSTS.value, HOST_ID.value
    if num_hosts < 1:
        raise SystemExit(f"--num_hosts={num_hosts}; expected >= 1")
    if host_id is not None and not 0 <= host_id < num_hosts:
        raise SystemExit(
            f"--host_id={host_id} is out of range for --num_hosts={num_hosts}; expected 0..{num_hosts - 1}"
        )
    import jax

    if num_hosts == 1:
        if jax.process_count() > 1:  # a multi-host TPU slice the runtime joined by itself
            raise SystemExit(
                f"--num_hosts=1 but this JAX job has {jax.process_count()} processes: pass "
                f"--num_hosts={jax.process_count()} (host 0 talks to the coordinator, the others follow)"
            )
        return 0

    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        if not JAX_COORDINATOR.value or host_id is None:
            raise SystemExit(
                f"--num_hosts={num_hosts} on the CPU platform needs --jax_coordinator=HOST:PORT and "
                "--host_id (nothing to auto-detect them from off Cloud TPU)"
            )
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=JAX_COORDINATOR.value or None, num_processes=num_hosts, process_id=host_id
    )
    if jax.process_count() != num_hosts:
        raise SystemExit(f"--num_hosts={num_hosts} but the JAX job has {jax.process_count()} processes")
    return jax.process_index()


def fail(message: str, code: int = 1):
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)
