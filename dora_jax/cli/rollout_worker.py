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
import time

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

    config = run_config.parse(cli.CONFIG.value)
    if host_id > 0:
        log.info("%s", follow(config, workdir, slice_id, host_id))
        return
    address = roles.require(roles.COORDINATOR, "coordinator")
    from dora_jax.transport.client import CallFailed, Client, CoordinatorUnreachable, Refused

    client = Client(address, roles.client_timing(), roles.client_credentials())
    try:
        outcome = serve(config, workdir, client, slice_id)
    except (CoordinatorUnreachable, Refused, CallFailed) as err:
        roles.fail(str(err))
    finally:
        client.close()
    log.info("%s", outcome)


def _build_worker(config, slice_id: int):
    """This slice's engine (its mesh spans every host of the slice) and worker."""
    import jax

    from dora_jax.parallel import sharding
    from dora_jax.runtime.build import make_tokenizer
    from dora_jax.runtime.roles import rollout as rollout_role

    tokenizer = make_tokenizer(config)
    served = rollout_role.model_config(config, tokenizer)
    try:
        mesh = sharding.make_mesh(jax.devices(), dict(config.mesh.rollout))
    except ValueError as err:
        raise SystemExit(
            f"mesh.rollout={dict(config.mesh.rollout)} over this slice's {jax.process_count()} host(s): {err}"
        ) from None
    engine = rollout_role.build_engine(config, served, mesh, tokenizer)
    return rollout_role.make_worker(config, engine, slice_id, tuple(served.eos_ids) or tuple(tokenizer.eos_ids))


def _host_channel(slice_id: int):
    """The slice's leader-to-followers channel, after every host checked it runs the same slice."""
    import jax

    import dora_jax
    from dora_jax.transport.host_mirror import HostChannel, check_same_slice

    check_same_slice(
        {
            "config_hash": roles.identity_hash(),
            "package_version": dora_jax.__version__,
            "slice_id": slice_id,
            "num_hosts": jax.process_count(),
        }
    )
    return HostChannel()


def _kv_transfer(engine, slice_id: int):
    """Migrated KV rows device to device (a single-process slice), or None: through the coordinator."""
    from dora_jax.transport.kv_transfer import KVTransfer

    try:
        return KVTransfer(engine, host=roles.transfer_host(), port=roles.transfer_port())
    except Exception as err:  # noqa: BLE001 - the rows still move, through the coordinator
        log.info(f"no transfer server for KV migration ({type(err).__name__}: {err}); sending KV inline")
        return None


def serve(config, workdir: str, client, slice_id: int) -> str:
    """Host 0: registers with the coordinator and serves its commands (mirrored to the other hosts)."""
    import jax

    from dora_jax.rollout import timeline
    from dora_jax.transport.host_mirror import MirroredWorker
    from dora_jax.transport.rollout_agent import RolloutAgent, fetch_from_store

    worker = _build_worker(config, slice_id)
    engine = worker.engine
    opened = []  # the store, once the trainer has created it
    puller = None
    if config.rollout.weights_transfer and jax.process_count() == 1:
        from dora_jax.transport.weights import WeightPull

        try:
            puller = WeightPull(
                jax.devices(), workdir, slice_id, host=roles.transfer_host(), port=roles.transfer_port()
            )
        except Exception as err:  # every version from the tensorstore tier, as without the option
            log.info(f"no transfer server ({type(err).__name__}: {err}); reading the tensorstore tier only")

    def fetch(version: int):
        if puller is not None:
            try:
                return puller.pull(version, engine.served_abstract_params())
            except Exception as err:  # not offered, expired, or the trainer is gone: the durable copy
                log.info(f"version {version} from the tensorstore tier ({type(err).__name__}: {err})")
        return fetch_from_store(opened[0], engine.param_shardings, wait_s=60.0)(version)

    mirror = MirroredWorker(worker, _host_channel(slice_id), fetch) if jax.process_count() > 1 else None
    agent = RolloutAgent(
        client,
        mirror or worker,
        mirror.fetch if mirror else fetch,
        roles.identity_hash(),
        silence_s=roles.CONNECT_TIMEOUT_S.value,
        kv_transfer=None if mirror else _kv_transfer(engine, slice_id),
        log=log.info,
    )
    try:
        agent.register()  # refused or unreachable: fail now, before any wait or compile
        log.info(f"registered with the coordinator at {client.address}; waiting for the first version")
        opened.append(_open_store(roles.versions_root(workdir), VERSION_WAIT_S.value))
        first = _first_version(opened[0], VERSION_WAIT_S.value)
        if mirror is not None:
            mirror.warmup(first)
        else:
            engine.warmup(fetch(first))
        log.info(f"ready ({len(jax.devices())} devices on {jax.process_count()} host(s), {worker.num_slots} slots)")
        outcome = agent.run()
    except BaseException as err:
        if mirror is not None:
            mirror.stop(f"host 0 failed: {type(err).__name__}: {err}")
        raise
    if mirror is not None:
        mirror.stop(outcome)
    try:
        timeline.write(workdir, slice_id, agent.timeline, worker.counters)
    except OSError as err:  # the run is over; only the plot's input is lost
        log.info(f"could not write its timeline: {err}")
    return outcome


def follow(config, workdir: str, slice_id: int, host_id: int) -> str:
    """Hosts 1..: replay host 0's engine calls until it stops; versions come from the same store."""
    from dora_jax.transport import host_mirror
    from dora_jax.transport.rollout_agent import fetch_from_store

    worker = _build_worker(config, slice_id)
    channel = _host_channel(slice_id)
    opened = []

    def fetch(version: int):
        if not opened:  # host 0 saw this version committed: the store exists
            opened.append(_open_store(roles.versions_root(workdir), VERSION_WAIT_S.value))
        return fetch_from_store(opened[0], worker.engine.param_shardings, wait_s=60.0)(version)

    log.info("following host 0")
    reason = host_mirror.follow(worker, channel, fetch, log=log.info)
    return f"stopped by host 0: {reason}"


def _open_store(root: str, wait_s: float):
    from dora_jax.store import ParamStore, TensorStoreTier

    deadline = time.monotonic() + wait_s
    while True:
        try:
            return ParamStore(TensorStoreTier(root, read_only=True))
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"no param store at {root} after {wait_s:.0f}s: is the trainer running with the "
                    "same --workdir / --versions?"
                ) from None
            time.sleep(0.5)


def _first_version(store, wait_s: float) -> int:
    deadline = time.monotonic() + wait_s
    while not store.versions():
        if time.monotonic() > deadline:
            raise SystemExit(f"the trainer published no version within {wait_s:.0f}s")
        time.sleep(0.5)
    return store.versions()[-1]


def run() -> None:
    """The `python -m dora_jax.rollout_worker` entry point."""
    app.run(main)


if __name__ == "__main__":
    run()
