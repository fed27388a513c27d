"""`python -m dora_jax.trainer_worker --config=C --workdir=W --coordinator=HOST:PORT [--versions=DIR|gs://...]`

The trainer role on its own devices (the trainer slice, `mesh.trainer`). It registers with the
coordinator first (a wrong config or package version is refused before any work), builds the
run's setup (the SFT cold start of a fresh model runs here, once, cached in W/sft), publishes
version 0 to the ParamStore's tensorstore tier (W/versions unless --versions) and reports it;
then `config.num_steps` times: TakeBatch -> make_train_batch -> train_step -> publish ->
ReportPublished, retiring the versions the coordinator no longer needs. Writes W/metrics.jsonl
(and TensorBoard events) like the embedded run. Exits 0 when done, 1 with the reason otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from absl import app, flags

from dora_jax import cli
from dora_jax.transport import roles

POLL_S = flags.DEFINE_float("poll_s", 10.0, "long-poll window of one TakeBatch call")


def main(argv):
    del argv
    roles.quiet_library_logs()
    cli.prepare_devices(cli.CONFIG.value)
    roles.initialize_distributed("trainer")
    workdir = roles.require(cli.WORKDIR, "workdir")
    address = roles.require(roles.COORDINATOR, "coordinator")
    from dora_jax import run_config
    from dora_jax.transport.client import CallFailed, Client, CoordinatorUnreachable, Refused, SessionLost

    config = run_config.parse(cli.CONFIG.value)
    client = Client(address, roles.client_timing())
    try:
        train(config, workdir, client)
    except (CoordinatorUnreachable, Refused, SessionLost, CallFailed) as err:
        roles.fail(str(err))
    finally:
        client.close()


def train(config, workdir: str, client) -> None:
    import jax

    from dora_jax import sharding
    from dora_jax.metrics import MetricsWriter
    from dora_jax.setup import build_setup
    from dora_jax.store import ParamStore, TensorStoreTier
    from dora_jax.trainer import Trainer, make_train_batch
    from dora_jax.transport import codec
    from dora_jax.transport import dora_pb2 as pb

    host_id = roles.HOST_ID.value
    client.register(pb.TRAINER, roles.identity_hash(), host_id=host_id)
    _log(f"registered with the coordinator at {client.address}; building the setup")
    os.makedirs(workdir, exist_ok=True)
    # The SFT cold start (cached in WORKDIR/sft) carves its trainer mesh out of the embedded run's
    # device split; this process holds only the trainer's devices, so the rollout slices may
    # overlap them there (time_shared): the trainer mesh it gets is the same.
    sft_view = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, time_shared=True))
    setup = build_setup(sft_view, workdir)
    try:
        mesh = sharding.make_mesh(jax.devices(), dict(config.mesh.trainer))
    except ValueError as err:
        raise SystemExit(f"mesh.trainer={dict(config.mesh.trainer)}: {err}") from None
    store = ParamStore(TensorStoreTier(roles.versions_root(workdir)))
    store.rollback_to(-1)  # versions of an earlier run in this root would clash with ours
    trainer = Trainer(setup.graphdef, setup.params, setup.axes, mesh, config.trainer, store)
    trainer.publish()
    report = _reporter(client, store, retire=host_id == 0)
    report(trainer.version)
    _log(f"published version {trainer.version} to {roles.versions_root(workdir)}")
    writer = MetricsWriter(workdir, tensorboard=config.tensorboard) if host_id == 0 else None
    start, last = time.perf_counter(), {}
    try:
        for step in range(config.num_steps):
            t0 = time.perf_counter()
            groups, stats = _take_batch(client, trainer.version)
            wait = time.perf_counter() - t0
            batch = make_train_batch([codec.group_from_proto(g) for g in groups], config.pad_to, setup.tokenizer.pad_id)
            metrics = trainer.train_step(batch)
            trainer.publish()
            report(trainer.version)
            if writer is not None:
                row = _row(step, batch, metrics, stats, last, start, wait)
                last = stats
                writer.write(step, row, {"staleness": [k for k, v in metrics.staleness.items() for _ in range(v)]})
                _log(f"step {step + 1}/{config.num_steps} reward {row['reward_mean']:.3f} "
                     f"staleness {row['staleness_max']} versions in flight {row['versions_in_flight']}")
    finally:
        if writer is not None:
            writer.close()
    print(json.dumps({"steps": config.num_steps, "version": trainer.version,
                      "wall_s": round(time.perf_counter() - start, 2)}), flush=True)


def _reporter(client, store, *, retire: bool):
    from dora_jax.transport import dora_pb2 as pb

    def report(version: int) -> None:
        request = pb.PublishedRequest(session=client.session, version=version)
        reply = client.call("ReportPublished", lambda t: client.stub.ReportPublished(request, timeout=t))
        if retire:
            store.retire_below(min(int(reply.oldest_needed), version))

    return report


def _take_batch(client, version: int):
    """Long-polls until the coordinator hands over the batch for `version`."""
    from dora_jax.transport import dora_pb2 as pb

    request = pb.TakeBatchRequest(session=client.session, trainer_version=version, wait_s=POLL_S.value)
    while True:
        reply = client.call("TakeBatch", lambda t: client.stub.TakeBatch(request, timeout=t),
                            timeout_s=POLL_S.value + client.timing.call_timeout_s)
        if reply.ready:
            return reply.groups, json.loads(reply.stats_json)


def _row(step, batch, metrics, stats: dict, last: dict, start: float, wait_s: float) -> dict:
    """The embedded run's metrics row, from the coordinator's counters sent with the batch."""
    delta = {k: stats.get(k, 0) - last.get(k, 0) for k in ("slot_steps", "idle_slot_steps", "generated_tokens")}
    valid = batch.valid_B > 0
    wall = time.perf_counter() - start
    row = {
        "reward_mean": float(batch.rewards_B[valid].mean()) if valid.any() else float("nan"),
        "valid_fraction": float(valid.mean()),
        "staleness_max": int(max(metrics.staleness)),
        "versions_in_flight": stats.get("versions_in_flight", 0),
        "trainer_wait_s": stats.get("trainer_wait_s", 0.0),
        "take_batch_s": wait_s,
        "bubble_ratio": delta["idle_slot_steps"] / delta["slot_steps"] if delta["slot_steps"] else 0.0,
        "generated_tokens": delta["generated_tokens"],
        "wall_s": wall,
        "response_len_mean": float(batch.loss_mask_BT.sum(1).mean()),
        "migrations_kv": stats.get("migrations_kv", 0),
    }
    row.update({k: v for k, v in metrics.as_dict().items() if not k.startswith("staleness/")})
    row["train_tokens_per_s"] = row.pop("tokens_per_s")
    row["tokens_per_s"] = float(batch.loss_mask_BT.sum()) / max(wall / (step + 1), 1e-9)
    return row


def _log(message: str) -> None:
    print(f"[trainer] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    app.run(main)
