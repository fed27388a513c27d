"""One process of a 2-process JAX job on CPU, for tests/transport/test_multihost.py.

    python -m tests.transport.multihost_job MODE PROCESS_ID PORT DIR

MODE `slices` (one job for every multi-host check, to pay the start-up once): first the slice
identity check, with hosts that agree (must pass) then hosts that claim other slice ids (must fail
on both with SystemExit; each host writes what it raised to DIR/identity{PROCESS_ID}.txt). Then a
rollout slice over both processes (mesh data=2 x tensor=2 over 2 x 2 fake devices): host 0 drives
`drive()` through a MirroredWorker, host 1 follows; params come from the tensorstore tier under
DIR/versions; host 0 writes the trajectories to DIR/rollout.pkl, host 1 what `follow` returned to
DIR/follower.txt. Then one Trainer step on mesh fsdp=4 over both processes, the same batch on
each, with the fixed-shape step and with the length-bucketed one (`TRAINERS`); host 0 writes the
gathered params of each to DIR/trainer_{name}.npz.

Every process (and the test's one-process references, see `fast_compiles`) compiles with most XLA
optimisations off: compiling, not running, is what these tiny programs cost.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys

N_PROCESSES, LOCAL_DEVICES = 2, 2
ROLLOUT_MESH = {"data": 2, "tensor": 2}
TRAINER_MESH = {"fsdp": 4}
# name -> TrainerConfig overrides of tests/trainer/test_trainer.py's CONFIG. One update and no KL
# term: a third of the compile time. The bucketed step runs make_batch's rows (12..32 positions) in
# micro-batches of 4 padded to 16 or 32, and reads the recomputed chunks back to host from both
# processes.
TRAINERS = {
    "fixed": dict(num_updates=1, micro_batch_size=8, kl_coef=0.0),
    "bucketed": dict(num_updates=1, micro_batch_size=4, kl_coef=0.0, length_bucket=16),
}


@contextlib.contextmanager
def fast_compiles():
    """Most XLA optimisations off for what compiles inside (jax_disable_most_optimizations, read
    at each compile), restored after."""
    import jax

    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


def drive(worker, fetch) -> dict:
    """A fixed sequence of worker calls (RolloutWorker or MirroredWorker): more requests than slots,
    one in-flight request exported with its KV and imported back later, queued ones taken and
    resubmitted. Returns {traj_id: Trajectory}."""
    from dora_jax.core.records import Request, SamplingParams

    worker.load_version(0, fetch(0))
    for i in range(6):
        worker.submit(
            Request(
                traj_id=f"t{i}",
                group_id=f"g{i // 2}",
                prompt_id=f"p{i}",
                prompt_ids=tuple(range(3, 8 + i)),
                version=0,
                max_new_tokens=10 + 3 * i,
                sampling=SamplingParams(temperature=1.0, seed=100 + i),
            )
        )
    done = {}

    def step():
        done.update({t.traj_id: t for t in worker.step()})

    for _ in range(4):
        step()
    states = worker.export_requests([worker.active_traj_ids[-1]])
    queued = worker.take_queued()
    for _ in range(3):
        step()
    worker.import_requests(states)
    for request in queued:
        worker.submit(request)
    for _ in range(200):
        if not worker.has_work:
            return done
        step()
    raise AssertionError("the worker is still busy after 200 steps")


def rollout_model():
    """tests/rollout's TINY model with one layer: what is checked here is across hosts, not across
    layers, and each layer is more to compile."""
    import dataclasses

    from tests.rollout.conftest import TINY

    return dataclasses.replace(TINY, num_layers=1)


def rollout_engine(devices):
    from dora_jax.parallel import sharding
    from dora_jax.rollout.engine import RolloutEngine
    from tests.rollout.conftest import ENGINE

    return RolloutEngine(rollout_model(), ENGINE, sharding.make_mesh(devices, ROLLOUT_MESH))


def trainer_step(devices, name: str):
    """One step of tests/trainer/test_trainer.py's batch on TRAINER_MESH over `devices`, with the
    trainer config TRAINERS[name], on its model with one layer (as `rollout_model`). Returns
    (trainer, metrics)."""
    import dataclasses

    from dora_jax.models import init_model, logical_axes, split
    from dora_jax.parallel import sharding
    from dora_jax.trainer import Trainer
    from tests.trainer.test_trainer import CFG, CONFIG, FAST_COMPILE, make_batch

    model = init_model(dataclasses.replace(CFG, num_layers=1), seed=0)
    graphdef, params = split(model)
    config = dataclasses.replace(CONFIG, **TRAINERS[name])
    trainer = Trainer(
        graphdef,
        params,
        logical_axes(model),
        sharding.make_mesh(devices, TRAINER_MESH),
        config,
        compiler_options=FAST_COMPILE,
    )
    metrics = trainer.train_step(make_batch(0, 0))
    return trainer, metrics


def step_traces(trainer) -> list[int]:
    """[fixed-shape step traces, bucketed gradient traces (one per bucket length)]."""
    return [trainer.trace_counts["train_step"], trainer.trace_counts["bucketed"]]


def main(mode: str, process_id: int, port: int, workdir: str) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={LOCAL_DEVICES}"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=N_PROCESSES, process_id=process_id
    )
    jax.config.update("jax_disable_most_optimizations", True)  # as fast_compiles(), for the whole job
    if mode != "slices":
        raise SystemExit(f"unknown mode {mode!r}")
    _identity(workdir)
    _rollout(workdir)
    _trainer(workdir)


def _identity(workdir: str) -> None:
    import jax

    from dora_jax.transport import host_mirror

    host_mirror.check_same_slice({"config_hash": "c" * 8, "slice_id": 0})  # the hosts agree: passes
    try:
        host_mirror.check_same_slice({"config_hash": "c" * 8, "slice_id": jax.process_index()})
    except SystemExit as err:
        raised = f"SystemExit: {err.code}"
    else:
        raised = "nothing"
    with open(os.path.join(workdir, f"identity{jax.process_index()}.txt"), "w") as f:
        f.write(raised)


def _rollout(workdir: str) -> None:
    import jax

    from dora_jax.rollout.worker import RolloutWorker
    from dora_jax.store import ParamStore, TensorStoreTier
    from dora_jax.transport import host_mirror
    from dora_jax.transport.rollout_agent import fetch_from_store

    worker = RolloutWorker(rollout_engine(jax.devices()))
    store = ParamStore(TensorStoreTier(os.path.join(workdir, "versions"), read_only=True))
    fetch = fetch_from_store(store, worker.engine.param_shardings)
    channel = host_mirror.HostChannel()
    if not channel.is_leader:
        _write(os.path.join(workdir, "follower.txt"), str(host_mirror.follow(worker, channel, fetch)).encode())
        return
    mirror = host_mirror.MirroredWorker(worker, channel, fetch)
    try:
        done = drive(mirror, mirror.fetch)
    finally:
        mirror.stop("done")
    _write(os.path.join(workdir, "rollout.pkl"), pickle.dumps({"trajectories": done, "counters": worker.counters}))


def _write(path: str, data: bytes) -> None:
    """Whole or not at all: the test reads the rollout results while the job goes on."""
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def _trainer(workdir: str) -> None:
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    for name in TRAINERS:
        trainer, metrics = trainer_step(jax.devices(), name)
        leaves = multihost_utils.process_allgather(jax.tree.leaves(trainer.params), tiled=True)
        if jax.process_index() == 0:
            np.savez(
                os.path.join(workdir, f"trainer_{name}.npz"),
                *[np.asarray(x) for x in leaves],
                loss=metrics.loss,
                grad_norm=metrics.grad_norm,
                traces=step_traces(trainer),
            )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
