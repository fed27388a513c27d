"""`python -m dora_jax.serve_coordinator --config=C --workdir=W --port=P [--config.x=y ...]`

The coordinator role: the same `Coordinator` as the embedded run, its reward pool and ledger
(W/ledger.jsonl, W/config.json), behind the gRPC service (dora_jax/transport). It waits until
every rollout slice (`rollout.num_slices` of `python -m dora_jax.rollout_worker`) has joined and
the trainer (`python -m dora_jax.trainer_worker`) has published its first version, then
dispatches. A workdir that already holds a ledger is resumed: the trainer restores its newest
checkpoint and hands over the coordinator state saved in it (or says there is none: then the
run starts over), which is restored before anything is dispatched; the ledger's `resume` event
voids what the lost processes wrote after that checkpoint. A trainer that registers while the run
is going (it was restarted) sends the run back the same way: the rollout workers' sessions end
(they drop their requests and join again, their engines warm) and the coordinator is rebuilt from
the state in the trainer's checkpoint. It runs until the trainer says it is done (`Finish`) or
SIGTERM/SIGINT: then it tells the rollout workers to stop and exits (0 when the trainer
finished). Uses no accelerator (JAX stays on the CPU).

Every call must carry a role token made from the run secret, which this process reads from
DORA_RUN_SECRET_FILE (or DORA_RUN_SECRET); with DORA_TLS_CERT_FILE and DORA_TLS_KEY_FILE it speaks
TLS (dora_jax/transport/auth.py, docs/security.md). It listens on `--host` (all interfaces unless
told: launch_local passes 127.0.0.1, a pod the VM's internal address).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading

from absl import app, flags

from dora_jax import cli
from dora_jax.cli import roles

log = logging.getLogger(__name__)

HOST = flags.DEFINE_string(
    "host",
    "[::]",
    "address to listen on: [::] is every interface; launch_local passes 127.0.0.1, a pod the VM's internal address",
)
START_TIMEOUT_S = flags.DEFINE_float(
    "start_timeout_s",
    3600.0,
    "how long to wait for every role to join (the trainer's SFT cold start and the first compiles happen meanwhile)",
)
HEARTBEAT_TIMEOUT_S = flags.DEFINE_float(
    "heartbeat_timeout_s",
    None,
    "a rollout worker silent this long is failed (default: rollout.heartbeat_timeout_s of the config)",
)
COMMAND_TIMEOUT_S = flags.DEFINE_float("command_timeout_s", 600.0, "a command unanswered this long fails its slice")
REJOIN_TIMEOUT_S = flags.DEFINE_float(
    "rejoin_timeout_s",
    600.0,
    "a dropped rollout slice is waited for this long to register again (restarted by its launcher); "
    "with every slice down and none back by then, the run stops",
)


def main(argv):
    del argv
    roles.quiet_library_logs()
    roles.log_as("coordinator")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # never take an accelerator a worker on this host needs
    cli.prepare_devices(cli.CONFIG.value)
    workdir = roles.require(cli.WORKDIR, "workdir")
    from dora_jax.coordinator.lease import LeaseHeld, WriterLease
    from dora_jax.core import fs
    from dora_jax.runtime import run_config
    from dora_jax.runtime.placements.coordinator_process import serve

    config = run_config.parse(cli.CONFIG.value)
    security = _security(config.rollout.num_slices)
    trace = None
    if cli.TRACE_LENGTHS.value:
        from dora_jax.coordinator.trace import LengthDistribution

        try:
            trace = (LengthDistribution.of(cli.CONFIG.value), int(cli.CONFIG.value.seed))
        except ValueError as err:
            raise app.UsageError(f"--trace_lengths: {err}") from None
    fs.makedirs(workdir)  # gs://: fails here, naming the path, without credentials or bucket
    stop = threading.Event()
    try:  # one coordinator per workdir (dora_jax.coordinator.lease); a lost lease stops this one
        lease = WriterLease.acquire(workdir, on_lost=lambda why: (log.info("stopping: %s", why), stop.set()))
    except LeaseHeld as err:
        roles.fail(str(err))
    with lease:
        with fs.open(fs.join(workdir, "config.json"), "w") as f:
            json.dump(roles.config_json(), f, indent=1, default=str)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        code = serve(config, workdir, stop, _context(), trace=trace, security=security)
    sys.exit(code)


def _security(num_slices: int):
    """(Authenticator, TLS certificate or None) from the variables the launcher set; exits naming
    them when the secret is missing: the coordinator never serves without authentication."""
    from dora_jax.transport import auth

    try:
        return auth.Authenticator(auth.load_secret(os.environ), num_slices), auth.load_server_tls(os.environ)
    except (ValueError, OSError) as err:
        roles.fail(f"cannot serve: {err}")


def _context():
    from dora_jax.runtime.placements.coordinator_process import Context

    return Context(
        identity_hash=roles.identity_hash(),
        host=HOST.value,
        port=cli.flag_or(cli.PORT, 50051),
        start_timeout_s=START_TIMEOUT_S.value,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S.value,
        command_timeout_s=COMMAND_TIMEOUT_S.value,
        rejoin_timeout_s=REJOIN_TIMEOUT_S.value,
    )


def run() -> None:
    """The `python -m dora_jax.serve_coordinator` entry point."""
    app.run(main)


if __name__ == "__main__":
    run()
