"""`python -m dora_jax.rollout_worker --config=C --workdir=W --coordinator=HOST:PORT --slice_id=N [--versions=...]`

One rollout slice as its own process: a RolloutEngine and RolloutWorker on this process's local
devices (`mesh.rollout`), driven by the coordinator's commands (dora_jax/transport/rollout_agent.py).
It registers first (a wrong config, package version or slice id is refused before any work), waits
for the trainer's first version in the ParamStore's tensorstore tier (W/versions unless
--versions), compiles every engine program with it, then serves: versions are read from the tier
with this slice's own shardings; finished trajectories and exported KV slot states go back over
gRPC. Exits 0 when the coordinator says stop, 1 with the reason otherwise.
"""

from __future__ import annotations

import sys
import time

from absl import app, flags

from dora_jax import cli
from dora_jax.transport import roles

SLICE_ID = flags.DEFINE_integer("slice_id", None, "this rollout slice's index, 0..rollout.num_slices-1")
VERSION_WAIT_S = flags.DEFINE_float("version_wait_s", 3600.0, "how long to wait for the trainer's first version "
                                    "(its SFT cold start runs meanwhile)")


def main(argv):
    del argv
    roles.quiet_library_logs()
    cli.prepare_devices(cli.CONFIG.value)
    roles.initialize_distributed("rollout")
    workdir = roles.require(cli.WORKDIR, "workdir")
    address = roles.require(roles.COORDINATOR, "coordinator")
    slice_id = roles.require(SLICE_ID, "slice_id")
    from dora_jax import run_config
    from dora_jax.transport.client import CallFailed, Client, CoordinatorUnreachable, Refused

    config = run_config.parse(cli.CONFIG.value)
    client = Client(address, roles.client_timing())
    try:
        outcome = serve(config, workdir, client, slice_id)
    except (CoordinatorUnreachable, Refused, CallFailed) as err:
        roles.fail(str(err))
    finally:
        client.close()
    _log(slice_id, outcome)


def serve(config, workdir: str, client, slice_id: int) -> str:
    import jax

    from dora_jax import sharding
    from dora_jax.rollout.engine import EngineConfig, RolloutEngine
    from dora_jax.rollout.worker import RolloutWorker
    from dora_jax.setup import make_tokenizer
    from dora_jax.transport.rollout_agent import RolloutAgent, fetch_from_store

    tokenizer = make_tokenizer(config)
    model_config = rollout_model_config(config, tokenizer)
    try:
        mesh = sharding.make_mesh(jax.devices(), dict(config.mesh.rollout))
    except ValueError as err:
        raise SystemExit(f"mesh.rollout={dict(config.mesh.rollout)}: {err}") from None
    engine = RolloutEngine(model_config, EngineConfig(num_slots=config.rollout.slots,
                                                      cache_length=config.rollout.cache_length,
                                                      max_prefill_length=config.rollout.max_prefill_length),
                           mesh, tokenizer=tokenizer)
    eos = tuple(model_config.eos_ids) or tuple(tokenizer.eos_ids)
    worker = RolloutWorker(engine, slice_id=slice_id, eos_ids=eos)
    opened = []  # the store, once the trainer has created it

    def fetch(version: int):
        return fetch_from_store(opened[0], engine.param_shardings, wait_s=60.0)(version)

    agent = RolloutAgent(client, worker, fetch, roles.identity_hash(), silence_s=roles.CONNECT_TIMEOUT_S.value,
                         log=lambda m: _log(slice_id, m))
    agent.register()  # refused or unreachable: fail now, before any wait or compile
    _log(slice_id, f"registered with the coordinator at {client.address}; waiting for the first version")
    opened.append(_open_store(roles.versions_root(workdir), VERSION_WAIT_S.value))
    first = _first_version(opened[0], VERSION_WAIT_S.value)
    engine.warmup(opened[0].get(first, engine.param_shardings))
    _log(slice_id, f"ready ({len(jax.devices())} devices, {worker.num_slots} slots)")
    return agent.run()


def rollout_model_config(config, tokenizer):
    """The served model's shapes, without its weights (those come from the store): the HF
    checkpoint's config.json, or the fresh model the trainer cold-starts."""
    from dora_jax import models
    from dora_jax.setup import fresh_model_config

    start = config.init.checkpoint or config.model.hf_path
    if start:
        return models.read_config(start, dtype=models.dtype_from_name(config.model.dtype),
                                  param_dtype=models.dtype_from_name(config.model.param_dtype))
    return fresh_model_config(config, tokenizer.vocab_size, tokenizer.eos_ids)


def _open_store(root: str, wait_s: float):
    from dora_jax.store import ParamStore, TensorStoreTier

    deadline = time.monotonic() + wait_s
    while True:
        try:
            return ParamStore(TensorStoreTier(root, read_only=True))
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise SystemExit(f"no param store at {root} after {wait_s:.0f}s: is the trainer running with the "
                                 "same --workdir / --versions?") from None
            time.sleep(0.5)


def _first_version(store, wait_s: float) -> int:
    deadline = time.monotonic() + wait_s
    while not store.versions():
        if time.monotonic() > deadline:
            raise SystemExit(f"the trainer published no version within {wait_s:.0f}s")
        time.sleep(0.5)
    return store.versions()[-1]


def _log(slice_id: int, message: str) -> None:
    print(f"[rollout {slice_id}] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    app.run(main)
