"""`python -m dora_jax.rollout_worker --config=C --workdir=W --coordinator=HOST:PORT --slice_id=N [--versions=...]
[--num_hosts=H --host_id=I --jax_coordinator=HOST0:PORT]`

One rollout slice as its own process: a RolloutEngine and RolloutWorker on this process's local
devices (`mesh.rollout`), driven by the coordinator's commands (dora_jax/transport/rollout_agent.py).
It registers first (a wrong config, package version or slice id is refused before any work), waits
for the trainer's first version in the ParamStore's tensorstore tier (W/versions unless
--versions), compiles every engine program with it, then serves: versions are read from the tier
with this slice's own shardings (or, with `rollout.weights_transfer` on a one-host slice, pulled
device to device from the trainer, the tier being the fallback); finished trajectories and
exported KV slot states go back over gRPC. Exits 0 when the coordinator says stop, 1 with the reason otherwise.

A slice over H > 1 hosts is one multi-controller JAX job (`--num_hosts`, see roles.py): its mesh
spans every host's devices; host 0 registers and serves as above, mirroring every engine call to
hosts 1..H-1, which run `follow` (dora_jax/transport/host_mirror.py) and need no --coordinator.
"""

from __future__ import annotations

import logging

from absl import app, flags

from dora_jax import cli
from dora_jax.cli import roles

log = logging.getLogger(__name__)

SLICE_ID = flags.DEFINE_integer("slice_id", None, "this rollout slice's index, 0..rollout.num_slices-1")
VERSION_WAIT_S = flags.DEFINE_float(
    "version_wait_s", 3600.0, "how long to wait for the trainer's first version (its SFT cold start runs meanwhile)"
)


def main(argv):
    del argv
    roles.quiet_library_logs()
    cli.prepare_devices(cli.CONFIG.value)
    host_id = roles.initialize_distributed("rollout")
    workdir = roles.require(cli.WORKDIR, "workdir")
    slice_id = roles.require(SLICE_ID, "slice_id")
    roles.log_as(f"rollout {slice_id}" + (f" host {host_id}" if host_id else ""))
    from dora_jax.runtime import run_config
    from dora_jax.runtime.placements.rollout_process import follow, serve

    config = run_config.parse(cli.CONFIG.value)
    context = _context(workdir)
    if host_id > 0:
        log.info("%s", follow(config, slice_id, context))
        return
    address = roles.require(roles.COORDINATOR, "coordinator")
    from dora_jax.transport.client import CallFailed, Client, CoordinatorUnreachable, Refused

    client = Client(address, roles.client_timing(), roles.client_credentials())
    try:
        outcome = serve(config, workdir, client, slice_id, context)
    except (CoordinatorUnreachable, Refused, CallFailed) as err:
        roles.fail(str(err))
    finally:
        client.close()
    log.info("%s", outcome)


def _context(workdir: str):
    from dora_jax.runtime.placements.rollout_process import Context

    return Context(
        identity_hash=roles.identity_hash(),
        versions_root=roles.versions_root(workdir),
        transfer_host=roles.transfer_host(),
        transfer_port=roles.transfer_port(),
        connect_timeout_s=roles.CONNECT_TIMEOUT_S.value,
        version_wait_s=VERSION_WAIT_S.value,
    )


def run() -> None:
    """The `python -m dora_jax.rollout_worker` entry point."""
    app.run(main)


if __name__ == "__main__":
    run()
