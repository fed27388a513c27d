"""The process placement of a rollout slice: the slice's engine and worker
(dora_jax.runtime.roles.rollout) on this process's devices (`mesh.rollout`), driven by the
coordinator's commands through a `RolloutAgent` (dora_jax/transport/rollout_agent.py).
`python -m dora_jax.rollout_worker` (dora_jax.cli.rollout_worker) parses the flags and calls
`serve` (host 0) or `follow` (hosts 1.. of a multi-host slice, which replay host 0's engine calls).

Versions are read from the ParamStore's tensorstore tier with the slice's own shardings (or, with
`rollout.weights_transfer` on a one-host slice, pulled device to device from the trainer, the
tier being the fallback); finished trajectories and exported KV slot states go back over gRPC.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax

import dora_jax
from dora_jax.parallel import sharding
from dora_jax.rollout import timeline
from dora_jax.runtime import faults
from dora_jax.runtime.build import make_tokenizer
from dora_jax.runtime.roles import rollout as rollout_role
from dora_jax.store import ParamStore, TensorStoreTier
from dora_jax.transport import host_mirror
from dora_jax.transport.host_mirror import HostChannel, MirroredWorker, check_same_slice
from dora_jax.transport.kv_transfer import KVTransfer
from dora_jax.transport.rollout_agent import RolloutAgent, fetch_from_store
from dora_jax.transport.weights import WeightPull

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Context:
    """What the command line gives a rollout process beside its config."""

    identity_hash: str  # the resolved config's digest: the coordinator admits only this run's roles
    versions_root: str  # the tensorstore tier's root (W/versions unless --versions)
    transfer_host: str | None = None  # where this process's transfer servers listen
    transfer_port: int = 0
    connect_timeout_s: float = 300.0  # give up once the coordinator has not answered this long
    version_wait_s: float = 3600.0  # how long to wait for the trainer's first version


def _build_worker(config, slice_id: int):
    """This slice's engine (its mesh spans every host of the slice) and worker."""

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


def _host_channel(slice_id: int, identity_hash: str):
    """The slice's leader-to-followers channel, after every host checked it runs the same slice."""

    check_same_slice(
        {
            "config_hash": identity_hash,
            "package_version": dora_jax.__version__,
            "slice_id": slice_id,
            "num_hosts": jax.process_count(),
        }
    )
    return HostChannel()


def _kv_transfer(engine, context: Context):
    """Migrated KV rows device to device (a single-process slice), or None: through the coordinator."""

    try:
        return KVTransfer(engine, host=context.transfer_host, port=context.transfer_port)
    except Exception as err:  # noqa: BLE001 - the rows still move, through the coordinator
        log.info(f"no transfer server for KV migration ({type(err).__name__}: {err}); sending KV inline")
        return None


def serve(config, workdir: str, client, slice_id: int, context: Context) -> str:
    """Host 0: registers with the coordinator and serves its commands (mirrored to the other hosts)."""

    worker = _build_worker(config, slice_id)
    engine = worker.engine
    opened = []  # the store, once the trainer has created it
    puller = None
    if config.rollout.weights_transfer and jax.process_count() == 1:
        try:
            puller = WeightPull(
                jax.devices(), workdir, slice_id, host=context.transfer_host, port=context.transfer_port
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

    mirror = (
        MirroredWorker(worker, _host_channel(slice_id, context.identity_hash), fetch)
        if jax.process_count() > 1
        else None
    )
    agent = RolloutAgent(
        client,
        mirror or worker,
        mirror.fetch if mirror else fetch,
        context.identity_hash,
        silence_s=context.connect_timeout_s,
        kv_transfer=None if mirror else _kv_transfer(engine, context),
        log=log.info,
        before_step=faults.before_rollout_step,
    )
    try:
        agent.register()  # refused or unreachable: fail now, before any wait or compile
        log.info(f"registered with the coordinator at {client.address}; waiting for the first version")
        opened.append(_open_store(context.versions_root, context.version_wait_s))
        first = _first_version(opened[0], context.version_wait_s)
        # Without compile_ahead, each program compiles when first used (on every host of a mirrored slice alike).
        if config.compile_ahead and mirror is not None:
            mirror.warmup(first)
        elif config.compile_ahead:
            rollout_role.warmup(config, engine, worker.scorer, fetch(first))
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


def follow(config, slice_id: int, context: Context) -> str:
    """Hosts 1..: replay host 0's engine calls until it stops; versions come from the same store."""

    worker = _build_worker(config, slice_id)
    channel = _host_channel(slice_id, context.identity_hash)
    opened = []

    def fetch(version: int):
        if not opened:  # host 0 saw this version committed: the store exists
            opened.append(_open_store(context.versions_root, context.version_wait_s))
        return fetch_from_store(opened[0], worker.engine.param_shardings, wait_s=60.0)(version)

    log.info("following host 0")
    reason = host_mirror.follow(worker, channel, fetch, log=log.info)
    return f"stopped by host 0: {reason}"


def _open_store(root: str, wait_s: float):

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
