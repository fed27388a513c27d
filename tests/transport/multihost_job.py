"""One process of a 2-process JAX job on CPU, for tests/transport/test_multihost.py.

    python -m tests.transport.multihost_job MODE PROCESS_ID PORT DIR

MODE `slices` (one job, to pay the start-up once): first a rollout slice over both processes (mesh
data=2 x tensor=2 over 2 x 2 fake devices): host 0 drives `drive()` through a MirroredWorker, host
1 follows; params come from the tensorstore tier under DIR/versions; host 0 writes the
trajectories to DIR/rollout.pkl. Then one Trainer step on mesh fsdp=4 over both processes, the
same batch on each; host 0 writes the gathered params to DIR/trainer.npz. MODE `identity`: each
host claims another slice id; `check_same_slice` must fail on both.
"""

from __future__ import annotations

import os
import pickle
import sys

N_PROCESSES, LOCAL_DEVICES = 2, 2
ROLLOUT_MESH = {"data": 2, "tensor": 2}
TRAINER_MESH = {"fsdp": 4}


def drive(worker, fetch) -> dict:
    """A fixed sequence of worker calls (RolloutWorker or MirroredWorker): more requests than slots,
    one in-flight request exported with its KV and imported back later, queued ones taken and
    resubmitted. Returns {traj_id: Trajectory}."""
    from dora_jax.records import Request, SamplingParams

    worker.load_version(0, fetch(0))
    for i in range(6):
        worker.submit(Request(traj_id=f"t{i}", group_id=f"g{i // 2}", prompt_id=f"p{i}",
                              prompt_ids=tuple(range(3, 8 + i)), version=0, max_new_tokens=10 + 3 * i,
                              sampling=SamplingParams(temperature=1.0, seed=100 + i)))
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


def rollout_engine(devices):
    from dora_jax import sharding
    from dora_jax.rollout.engine import RolloutEngine
    from tests.rollout.conftest import ENGINE, TINY

    return RolloutEngine(TINY, ENGINE, sharding.make_mesh(devices, ROLLOUT_MESH))


def trainer_step(devices):
    """One step of tests/trainer/test_trainer.py's batch on TRAINER_MESH over `devices` (its config
    with one update of two micro-batches and no KL term: a third of the compile time)."""
    import dataclasses

    from dora_jax import sharding
    from dora_jax.models import init_model, logical_axes, split
    from dora_jax.trainer import Trainer
    from tests.trainer.test_trainer import CFG, CONFIG, FAST_COMPILE, make_batch

    model = init_model(CFG, seed=0)
    graphdef, params = split(model)
    config = dataclasses.replace(CONFIG, num_updates=1, micro_batch_size=8, kl_coef=0.0)
    trainer = Trainer(graphdef, params, logical_axes(model), sharding.make_mesh(devices, TRAINER_MESH), config,
                      compiler_options=FAST_COMPILE)
    metrics = trainer.train_step(make_batch(0, 0))
    return trainer, metrics


def main(mode: str, process_id: int, port: int, workdir: str) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={LOCAL_DEVICES}"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=N_PROCESSES,
                               process_id=process_id)
    from dora_jax.transport import host_mirror

    if mode == "identity":
        host_mirror.check_same_slice({"config_hash": "c" * 8, "slice_id": process_id})
    elif mode == "slices":
        _rollout(workdir)
        _trainer(workdir)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


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
        print("follower:", host_mirror.follow(worker, channel, fetch), flush=True)
        return
    mirror = host_mirror.MirroredWorker(worker, channel, fetch)
    try:
        done = drive(mirror, mirror.fetch)
    finally:
        mirror.stop("done")
    with open(os.path.join(workdir, "rollout.pkl"), "wb") as f:
        pickle.dump({"trajectories": done, "counters": worker.counters}, f)


def _trainer(workdir: str) -> None:
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    trainer, metrics = trainer_step(jax.devices())
    leaves = multihost_utils.process_allgather(jax.tree.leaves(trainer.params), tiled=True)
    if jax.process_index() == 0:
        np.savez(os.path.join(workdir, "trainer.npz"), *[np.asarray(x) for x in leaves], loss=metrics.loss,
                 grad_norm=metrics.grad_norm)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
