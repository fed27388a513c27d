"""`python -m dora_jax.trainer_worker --config=C --workdir=W --coordinator=HOST:PORT [--versions=DIR|gs://...]`

The trainer role on its own devices (the trainer slice, `mesh.trainer`). It registers with the
coordinator first (a wrong config or package version is refused before any work), builds the
run's setup (the SFT cold start of a fresh model runs here, once, cached in W/sft), publishes
version 0 to the ParamStore's tensorstore tier (W/versions unless --versions) and reports it;
With `rollout.weights_transfer` (a one-host trainer), every version is also offered to the rollout
slices device to device (dora_jax/transport/weights.py) before the coordinator hears of it.
Then `config.num_steps` times: TakeBatch -> make_train_batch -> train_step -> publish ->
ReportPublished, retiring the versions the coordinator no longer needs; at the end `Finish`
(the coordinator stops the rollout workers and exits). With `eval.every_steps` it asks the
coordinator for evaluation rounds (`Evaluate`, dora_jax.transport.evaluation) at the versions the
embedded run evaluates, through the same `Evaluator`, and waits for the last one before `Finish`.
Writes W/metrics.jsonl (with the `eval/*` rows), W/eval_samples.jsonl, TensorBoard events, W&B
and W/reward_curve.png like the embedded run. Exits 0 when done, 1 with the reason otherwise.

Every `checkpoint.every_steps` steps it saves a run checkpoint (W/checkpoints, as the embedded
run does: trainer state, the older versions still needed, and the coordinator's state from its
`Snapshot`, taken at the same version). When the coordinator says the workdir held a run (a pod
preempted as a whole, relaunched on the same workdir), the trainer restores the newest
checkpoint that restores, publishes its versions again, hands the coordinator state over
(`Resume`) and continues from that step; with no checkpoint the run starts over.

A trainer over H > 1 hosts (`--num_hosts`, see roles.py) is one multi-controller JAX job: host 0
alone talks to the coordinator and sends every batch to the other hosts over a JAX collective;
every host runs the same step and writes its shards of each published version; host 0 reports
the publish, retires versions and writes the metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import signal
import sys
import threading
import time

from absl import app, flags

from dora_jax import cli
from dora_jax.cli import roles
from dora_jax.core import fs

POLL_S = flags.DEFINE_float("poll_s", 10.0, "long-poll window of one TakeBatch call")


def main(argv):
    del argv
    roles.quiet_library_logs()
    cli.prepare_devices(cli.CONFIG.value)
    host_id = roles.initialize_distributed("trainer")
    workdir = roles.require(cli.WORKDIR, "workdir")
    from dora_jax.runtime import run_config

    config = run_config.parse(cli.CONFIG.value)
    if host_id > 0:
        train(config, workdir, None)
        return
    address = roles.require(roles.COORDINATOR, "coordinator")
    from dora_jax.transport.client import CallFailed, Client, CoordinatorUnreachable, Refused, SessionLost

    client = Client(address, roles.client_timing(), roles.client_credentials())
    stop = threading.Event()  # SIGTERM (a preemption notice, `ray job stop`): checkpoint and exit 75
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        train(config, workdir, client, stop)
    except (CoordinatorUnreachable, Refused, SessionLost, CallFailed) as err:
        roles.fail(str(err))
    finally:
        client.close()


def train(config, workdir: str, client, stop: threading.Event | None = None) -> None:
    """The training loop; `client` is None on hosts 1.. of a multi-host trainer, which take every
    batch from host 0 (`_BatchSource`) and run the same step and publish. `stop` set (SIGTERM on a
    one-host trainer) ends it after the step in progress with a checkpoint: exit status 75, the run
    not finished (the same command on the workdir resumes it)."""
    import jax

    from dora_jax.parallel import sharding
    from dora_jax.runtime import training_loop
    from dora_jax.runtime.metrics import MetricsWriter, WandbSpec, draw_reward_curve
    from dora_jax.trainer import Trainer
    from dora_jax.transport import dora_pb2 as pb
    from dora_jax.transport.client import CoordinatorUnreachable, SessionLost

    leader = client is not None
    channel = _host_channel() if jax.process_count() > 1 else None
    resuming = False
    if leader:
        resuming = client.register(pb.TRAINER, roles.identity_hash(), host_id=0).resume
        _log(f"registered with the coordinator at {client.address}; building the setup")
    if channel is not None:  # every host restores (orbax restores collectively)
        resuming = channel.exchange(b"resume" if resuming else None) == b"resume"
    fs.makedirs(workdir)  # gs://: fails here, naming the path, without credentials or bucket
    try:
        mesh = sharding.make_mesh(jax.devices(), dict(config.mesh.trainer))
    except ValueError as err:
        raise SystemExit(
            f"mesh.trainer={dict(config.mesh.trainer)} over {jax.process_count()} host(s): {err}"
        ) from None
    setup, store = _setup_and_store(config, workdir, channel, mesh)
    trainer = Trainer(setup.graphdef, setup.params, setup.axes, mesh, config.trainer, store)
    checkpoints = _Checkpoints(config, workdir, trainer, store, setup, client, channel)
    if resuming:
        checkpoints.restore()
    elif checkpoints.steps():
        raise SystemExit(
            f"{checkpoints.directory} holds checkpoints {checkpoints.steps()} but the coordinator found no "
            "ledger in the workdir: not this run's; give a new --workdir or remove them"
        )
    trainer.publish()
    offer = None
    if leader and channel is None and config.rollout.weights_transfer:
        from dora_jax.transport.weights import WeightOffer

        try:
            offer = WeightOffer(
                jax.devices(),
                dict(config.mesh.rollout),
                setup.axes,
                trainer.serve_dtype,
                config.rollout.num_slices,
                workdir,
                keep_versions=config.coordinator.k_max + 2,  # a slice loads a version within C3's window
                host=roles.transfer_host(),
                port=roles.transfer_port(),
            )
            _log(f"offering every version device to device at {offer.address}")
        except Exception as err:  # the slices read the tensorstore tier, as without the option
            _log(f"no transfer server ({type(err).__name__}: {err}); versions go through the tensorstore tier only")
    # The store has the version (the slices fetch it and warm up meanwhile): compile every train-step
    # shape before the coordinator hears of it, so no step compiles while the run is timed.
    widths = trainer.warmup(config.rollout.cache_length, config.coordinator.train_batch_size, config.pad_to)
    if widths:
        _log(f"compiled the train step for micro-batch lengths {widths}")
    before = functools.partial(_offer, offer, trainer) if offer else None
    report = _reporter(client, store, before) if leader else (lambda version, digests=None: None)
    report(trainer.version)
    _log(f"published version {trainer.version} to {roles.versions_root(workdir)}")
    source = _BatchSource(client, channel, report)
    writer, evaluation, evaluator = None, None, None
    if leader:
        writer = MetricsWriter(
            workdir, tensorboard=config.tensorboard, wandb=WandbSpec.of(config.log), config=roles.config_json()
        )
        evaluation, evaluator = _evaluator(config, setup, client, workdir, writer)
        evaluator.maybe_request(trainer.version)
    after_step = functools.partial(_after_step, evaluator, checkpoints)
    start = time.perf_counter()

    def on_row(row: dict) -> None:
        if leader:
            _log(
                f"step {trainer.version}/{config.num_steps} reward {row['reward_mean']:.3f} "
                f"staleness {row['staleness_max']} versions in flight {row['versions_in_flight']}"
            )

    try:
        while True:
            try:
                training_loop.train(
                    trainer,
                    source,
                    **training_loop.sizes(config, setup.tokenizer.pad_id),
                    writer=writer,
                    after_step=after_step,
                    on_row=on_row,
                    start=start,
                    should_stop=stop.is_set if stop is not None and channel is None else None,
                )
                break
            except (SessionLost, CoordinatorUnreachable) as err:
                if channel is not None or not checkpoints.steps():
                    raise  # a multi-host trainer, or nothing to go back to: the job is relaunched
                _log(f"lost the coordinator ({err}); joining again to resume from the newest checkpoint")
                _rejoin(client, store, trainer, checkpoints)
                report(trainer.version)
        if trainer.version < config.num_steps:
            if checkpoints.last_saved != trainer.version:
                checkpoints.save()  # stopped between scheduled checkpoints
        elif evaluator is not None:
            evaluator.harvest(timeout=config.eval.final_timeout_s)  # the last version's round
            if evaluator.pending:
                _log(f"{evaluator.pending} evaluation rounds did not finish; their rows are missing")
    except BaseException:
        source.abort()
        raise
    finally:
        if evaluation is not None:
            evaluation.close()
        if writer is not None:
            curve = draw_reward_curve(workdir)
            writer.close(images={"reward_curve": curve} if curve else None)
        checkpoints.close()
        try:
            store.flush()  # the last version durable before the coordinator stops the slices
        except OSError as err:
            _log(str(err))
    if trainer.version < config.num_steps:  # stopped (SIGTERM) after its checkpoint: not finished
        _log(f"stopped at step {trainer.version} of {config.num_steps} after a checkpoint; rerun to resume")
        sys.exit(75)
    if leader:  # after the last checkpoint: the coordinator stops the workers and exits
        finish = pb.FinishRequest(session=client.session)
        client.call("Finish", lambda t: client.stub.Finish(finish, timeout=t))
    print(
        json.dumps(
            {"steps": config.num_steps, "version": trainer.version, "wall_s": round(time.perf_counter() - start, 2)}
        ),
        flush=True,
    )


def _evaluator(config, setup, client, workdir: str, writer):
    """(the port, the Evaluator) of host 0: rounds asked over gRPC (`Evaluate`), the rows
    written here. The trainer's copy of the held-out prompts gives the responses' prompts text."""
    from dora_jax.runtime.evaluator import Evaluator
    from dora_jax.runtime.run_config import task_config
    from dora_jax.tasks.eval_set import eval_prompts
    from dora_jax.transport.evaluation import RemoteEvaluation

    held_out = []
    if config.eval.enabled:
        held_out = eval_prompts(
            task_config(config), setup.task, setup.tokenizer, config.eval.num_prompts, config.eval.path
        )
    evaluation = RemoteEvaluation(client)
    # Leaks: None: the training prompts are drawn at the coordinator, whose rounds count them.
    decode = setup.tokenizer.decode
    evaluator = Evaluator(config.eval, config.num_steps, held_out, None, evaluation, decode, workdir, writer)
    return evaluation, evaluator


def _after_step(evaluator, checkpoints, step: int) -> dict:
    """As the embedded run: the next version's round asked, finished rounds written, a checkpoint."""
    if evaluator is not None:
        evaluator.maybe_request(step + 1)
        evaluator.harvest()
    return checkpoints.after_step(step)


def _rejoin(client, store, trainer, checkpoints) -> None:
    """A restarted coordinator: register again (it finds the ledger and asks for a resume), go
    back to the newest checkpoint and publish its versions again."""
    from dora_jax.transport import dora_pb2 as pb

    if not client.register(pb.TRAINER, roles.identity_hash(), host_id=0).resume:
        raise SystemExit("the coordinator answering now is not resuming this run; stopping")
    store.rollback_to(-1)  # versions after the checkpoint are trained again, maybe differently
    if not checkpoints.restore():
        raise SystemExit("no checkpoint restores: relaunch the job (it starts over)")
    trainer.publish()


class _Checkpoints:
    """The trainer role's run checkpoints (dora_jax.runtime.checkpoint, meta as
    dora_jax.runtime.resume says). Host 0 gets the coordinator's state; every host saves and
    restores its shards."""

    def __init__(self, config, workdir: str, trainer, store, setup, client, channel):
        from dora_jax.runtime import resume
        from dora_jax.runtime.checkpoint import RunCheckpointer, directory_of

        self.directory = directory_of(workdir)
        self._every = config.checkpoint_every
        self._checkpointer = RunCheckpointer(self.directory, keep=config.checkpoint_keep)
        self._trainer, self._store, self._client, self._channel = trainer, store, client, channel
        self._workdir = workdir
        self._fingerprint = resume.fingerprint(config, setup)
        self.last_saved: int | None = None  # the trainer version of the newest checkpoint this process saved

    def steps(self) -> list[int]:
        return self._checkpointer.steps()

    def restore(self) -> bool:
        """Loads the newest checkpoint that restores into the trainer and the store, and hands
        its coordinator state to the coordinator (host 0); without one the run starts over.
        Returns whether a checkpoint was restored."""
        from dora_jax.runtime import resume
        from dora_jax.runtime.checkpoint import abstract_like
        from dora_jax.transport import dora_pb2 as pb

        trainer = self._trainer
        restored = self._checkpointer.restore_latest(
            lambda: abstract_like(trainer.state, trainer.state_shardings),
            lambda: abstract_like(trainer.params, trainer.param_shardings),
        )
        state = None
        if restored is not None:
            resume.check_resumable(restored.meta["fingerprint"], self._fingerprint)
            trainer.load_state(restored.trainer_state, restored.meta["trainer_version"])
            for version in sorted(restored.versions):  # the store was emptied at start
                self._store.publish(version, restored.versions[version])
            state = {"coordinator": restored.meta["coordinator"], "prompts": restored.meta["prompts"]}
        start = trainer.version
        if self._client is not None:
            resume.trim_rows(fs.join(self._workdir, "metrics.jsonl"), start)
            resume.trim_rows(fs.join(self._workdir, "eval_samples.jsonl"), start)
            request = pb.ResumeRequest(
                session=self._client.session, has_state=state is not None, state_json=json.dumps(state or {})
            )
            self._client.call("Resume", lambda t: self._client.stub.Resume(request, timeout=t))
            _log(f"resumed from the checkpoint of step {start}" if state else "no checkpoint restores: starting over")
        return state is not None

    def after_step(self, step: int) -> dict:
        if not self._every or (step + 1) % self._every:
            return {}
        return self.save()

    def save(self) -> dict:
        """A checkpoint of the trainer's state now, with the coordinator's from its Snapshot."""
        from dora_jax.runtime.checkpoint import CheckpointError

        trainer, t0 = self._trainer, time.perf_counter()
        meta = None
        if self._client is not None:
            try:
                meta = self._meta()
            except Exception as err:  # the run goes on; the previous checkpoint stays in use
                _log(f"no checkpoint at step {trainer.version}: {err}")
        if self._channel is not None:
            meta = json.loads(self._channel.exchange(json.dumps(meta).encode() if self._channel.is_leader else None))
        if meta is None:
            return {"checkpoint_error": 1}
        versions = {v: self._store.get(v, trainer.param_shardings, copy=False) for v in meta["versions"]}
        try:
            self._checkpointer.save(trainer.version, trainer.state, versions, meta)
        except CheckpointError as err:
            _log(f"{err}; the previous checkpoint stays in use")
            return {"checkpoint_error": 1}
        self.last_saved = trainer.version
        return {"checkpoint_s": time.perf_counter() - t0}

    def _meta(self) -> dict:
        from dora_jax.runtime import resume
        from dora_jax.transport import dora_pb2 as pb

        version = self._trainer.version
        request = pb.SnapshotRequest(session=self._client.session, trainer_version=version)
        reply = self._client.call("Snapshot", lambda t: self._client.stub.Snapshot(request, timeout=t))
        state = json.loads(reply.state_json)
        prompts = state["extra"].pop("prompts")
        return resume.meta(state, version, prompts, self._fingerprint)

    def close(self) -> None:
        from dora_jax.runtime.checkpoint import CheckpointError

        try:
            self._checkpointer.close()
        except CheckpointError as err:
            _log(str(err))


def _host_channel():
    import jax

    import dora_jax
    from dora_jax.transport.host_mirror import HostChannel, check_same_slice

    check_same_slice(
        {
            "config_hash": roles.identity_hash(),
            "package_version": dora_jax.__version__,
            "role": "trainer",
            "num_hosts": jax.process_count(),
        }
    )
    return HostChannel()


def _setup_and_store(config, workdir: str, channel, mesh):
    """The run's setup (a HF checkpoint read straight into `mesh`'s shardings) and the ParamStore,
    emptied of an earlier run's versions.

    Several hosts: host 0 builds the setup first (the SFT cold start, if any, runs on its own
    devices and is cached in WORKDIR/sft, which the trainer's hosts must share) and clears the
    versions root; then the other hosts build theirs (reading that cache) and open the root.
    """
    import jax

    from dora_jax.runtime.build import build_setup
    from dora_jax.store import ParamStore, TensorStoreTier
    from dora_jax.store.recent import RecentTier

    # The SFT cold start carves its trainer mesh out of the embedded run's device split; this
    # process holds only the trainer's devices, so the rollout slices may overlap them there
    # (time_shared). On several hosts host 0 trains it alone, on its local devices (the first
    # ones of jax.devices()), so that the others need not take part in it.
    sft_mesh = dataclasses.replace(config.mesh, time_shared=True)
    if channel is not None:
        sft_mesh = dataclasses.replace(sft_mesh, trainer=(("fsdp", jax.local_device_count()),))
    sft_view = dataclasses.replace(config, mesh=sft_mesh)
    root = roles.versions_root(workdir)

    def tier(durable):
        # The behaviour recompute reads the versions this trainer published up to k_max steps ago:
        # from memory, not back from disk or GCS. Several hosts keep them on device (a version
        # sharded over processes cannot be gathered into one host's memory). The durable write of
        # each version runs in the background while the next step trains.
        keep = config.coordinator.k_max + 1
        return RecentTier(durable, keep, device_versions=1 if jax.process_count() == 1 else keep)

    if channel is None or channel.is_leader:
        setup = build_setup(sft_view, workdir, mesh=mesh)
        store = ParamStore(tier(TensorStoreTier(root, background_writes=True)))
        store.rollback_to(-1)  # versions of an earlier run in this root would clash with ours
        if channel is not None:
            channel.send(b"setup done")
        return setup, store
    channel.receive()
    if _runs_cold_start(config) and not fs.exists(fs.join(workdir, "sft", "DONE")):
        raise SystemExit(
            f"host {jax.process_index()} of the trainer finds no SFT cold start in {workdir}/sft after "
            "host 0 wrote it there: the trainer's hosts must share --workdir (or set init.checkpoint)"
        )
    return build_setup(sft_view, workdir, mesh=mesh), ParamStore(tier(TensorStoreTier(root, background_writes=True)))


def _runs_cold_start(config) -> bool:
    """Whether build_setup trains (and caches) an SFT cold start, as dora_jax.runtime.build.cold_start decides."""
    fresh = not (config.init.checkpoint or config.model.hf_path)
    return fresh and config.init.sft_steps > 0 and config.task.kind == "running_sums"


class _BatchSource:
    """The trainer role's `training_loop.BatchSource`. Host 0 long-polls the coordinator and, on
    several hosts, sends the reply to the others, so every host trains on the same batch (an
    empty message: host 0 stopped); host 0 reports each publish."""

    def __init__(self, client, channel, report):
        self._client, self._channel, self._report = client, channel, report

    def take(self, version: int):
        from dora_jax.runtime import training_loop
        from dora_jax.transport import codec
        from dora_jax.transport import dora_pb2 as pb

        if self._client is not None:
            reply = _take_batch(self._client, version)
            if self._channel is not None:
                self._channel.send(reply.SerializeToString())
        else:
            payload = self._channel.receive()
            if not payload:
                raise SystemExit("host 0 of the trainer stopped; stopping too")
            reply = pb.TakeBatchReply.FromString(payload)
        return training_loop.TakenBatch([codec.group_from_proto(g) for g in reply.groups], json.loads(reply.stats_json))

    def published(self, version: int, behaviour_digests) -> None:
        self._report(version, behaviour_digests)

    def counters(self) -> dict:
        return {}  # the first row counts from zero: the coordinator's counters start with the run

    def abort(self) -> None:
        """Host 0 failed: releases the other hosts from their wait for the next batch."""
        if self._client is not None and self._channel is not None:
            with contextlib.suppress(Exception):
                self._channel.send(b"")


def _offer(offer, trainer, version: int) -> None:
    """Offers `version` device to device; a failure leaves the slices the tensorstore tier."""
    try:
        offer.offer(version, trainer.served_params())
    except Exception as err:
        _log(f"version {version} not offered device to device ({type(err).__name__}: {err}); the tier has it")


def _reporter(client, store, before=None):
    """Host 0 reports each publish and retires the versions the coordinator no longer needs;
    `before(version)` runs first (the device-to-device offer, before any slice is told to load)."""
    from dora_jax.transport import dora_pb2 as pb

    def report(version: int, behaviour_digests=None) -> None:
        if before is not None:
            before(version)
        request = pb.PublishedRequest(
            session=client.session, version=version, behaviour_digests=behaviour_digests or {}
        )
        reply = client.call("ReportPublished", lambda t: client.stub.ReportPublished(request, timeout=t))
        store.retire_below(min(int(reply.oldest_needed), version))

    return report


def _take_batch(client, version: int):
    """Long-polls until the coordinator hands over the batch for `version` (a TakeBatchReply)."""
    from dora_jax.transport import dora_pb2 as pb

    request = pb.TakeBatchRequest(session=client.session, trainer_version=version, wait_s=POLL_S.value)
    while True:
        reply = client.call(
            "TakeBatch",
            lambda t: client.stub.TakeBatch(request, timeout=t),
            timeout_s=POLL_S.value + client.timing.call_timeout_s,
        )
        if reply.ready:
            return reply


def _log(message: str) -> None:
    print(f"[trainer] {message}", file=sys.stderr, flush=True)


def run() -> None:
    """The `python -m dora_jax.trainer_worker` entry point."""
    app.run(main)


if __name__ == "__main__":
    run()
