"""The process placement of the trainer role: the trainer on its own devices (`mesh.trainer`),
its ports the coordinator's gRPC service and, on a trainer of several hosts, a JAX collective from
host 0 to the others. `python -m dora_jax.trainer_worker` (dora_jax.cli.trainer_worker) parses the
flags and calls `train`; what the role does is written once in dora_jax.runtime.roles.trainer.

It registers with the coordinator first (a wrong config or package version is refused before any
work), builds the run's setup (the SFT cold start of a fresh model runs here, once, cached in
W/sft), publishes version 0 to the ParamStore's tensorstore tier and reports it; with
`rollout.weights_transfer` (a one-host trainer), every version is also offered to the rollout
slices device to device (dora_jax/transport/weights.py) before the coordinator hears of it. Then
`config.num_steps` times: TakeBatch -> make_train_batch -> train_step -> publish ->
ReportPublished, retiring the versions the coordinator no longer needs; evaluation rounds asked
with `Evaluate` (dora_jax.transport.evaluation) through the same `Evaluator` as the embedded run;
at the end `Finish`. Checkpoints every `checkpoint.every_steps` steps (the coordinator's state from
its `Snapshot`); a resumed run restores the newest one and hands the coordinator its state
(`Resume`). On H > 1 hosts, host 0 alone talks to the coordinator and sends every batch to the
others; every host runs the same step and writes its shards of each version.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import sys
import threading
import time

import jax

import dora_jax
from dora_jax.core import fs
from dora_jax.parallel import sharding
from dora_jax.runtime import resume, training_loop
from dora_jax.runtime.build import build_setup
from dora_jax.runtime.checkpoint import CheckpointError, RunCheckpointer, directory_of
from dora_jax.runtime.evaluator import Evaluator
from dora_jax.runtime.roles import coordinator as coordinator_role
from dora_jax.runtime.roles import trainer as trainer_role
from dora_jax.store import ParamStore, TensorStoreTier
from dora_jax.store.recent import RecentTier
from dora_jax.trainer import Trainer
from dora_jax.transport import codec
from dora_jax.transport import dora_pb2 as pb
from dora_jax.transport.client import CoordinatorUnreachable, SessionLost
from dora_jax.transport.evaluation import RemoteEvaluation
from dora_jax.transport.host_mirror import HostChannel, check_same_slice
from dora_jax.transport.weights import WeightOffer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Context:
    """What the command line gives the trainer process beside its config."""

    identity_hash: str  # the resolved config's digest: the coordinator admits only this run's roles
    config_json: dict  # the resolved config, for the trackers (W&B)
    versions_root: str  # the tensorstore tier's root (W/versions unless --versions)
    transfer_host: str | None = None  # where the device-to-device weights server listens
    transfer_port: int = 0
    poll_s: float = 10.0  # long-poll window of one TakeBatch call


def train(config, workdir: str, client, context: Context, stop: threading.Event | None = None) -> None:
    """The training loop; `client` is None on hosts 1.. of a multi-host trainer, which take every
    batch from host 0 (`_BatchSource`) and run the same step and publish. `stop` set (SIGTERM on a
    one-host trainer) ends it after the step in progress with a checkpoint: exit status 75, the run
    not finished (the same command on the workdir resumes it)."""
    role = _PodTrainer(config, workdir, client, context, stop)
    role.build()
    start = time.perf_counter()
    role.run(start)
    if role.trainer.version < config.num_steps:  # stopped (SIGTERM) after its checkpoint: not finished
        log.info("stopped at step %d of %d after a checkpoint; rerun to resume", role.trainer.version, config.num_steps)
        sys.exit(75)
    if client is not None:  # after the last checkpoint: the coordinator stops the workers and exits
        finish = pb.FinishRequest(session=client.session)
        client.call("Finish", lambda t: client.stub.Finish(finish, timeout=t))
    summary = {"steps": config.num_steps, "version": role.trainer.version}
    print(json.dumps({**summary, "wall_s": round(time.perf_counter() - start, 2)}), flush=True)


class _PodTrainer:
    """The process placement of the trainer role (dora_jax.runtime.roles.trainer): its ports are
    the coordinator's gRPC service (host 0) and, on several hosts, a JAX collective to the others."""

    def __init__(self, config, workdir: str, client, context: Context, stop: threading.Event | None):

        self.config, self.workdir, self.client, self.stop = config, workdir, client, stop
        self.context = context
        self.leader = client is not None
        self.channel = _host_channel(context) if jax.process_count() > 1 else None
        self.writer = self.evaluation = self.evaluator = None

    def build(self) -> None:
        """Registers, builds the trainer (restored from the newest checkpoint when the run
        resumes), publishes and reports its version, and opens what host 0 writes."""

        config, workdir, context = self.config, self.workdir, self.context
        resuming = self._register()
        fs.makedirs(workdir)  # gs://: fails here, naming the path, without credentials or bucket
        mesh = _trainer_mesh(config)
        self.setup, self.store = _setup_and_store(config, workdir, self.channel, mesh, context.versions_root)
        setup = self.setup
        self.trainer = Trainer(setup.graphdef, setup.params, setup.axes, mesh, config.trainer, self.store)
        self.checkpoints = _Checkpoints(config, workdir, self.trainer, self.store, setup, self.client, self.channel)
        if resuming:
            self.checkpoints.restore()
        elif self.checkpoints.steps():
            raise SystemExit(
                f"{self.checkpoints.directory} holds checkpoints {self.checkpoints.steps()} but the coordinator "
                "found no ledger in the workdir: not this run's; give a new --workdir or remove them"
            )
        self.trainer.publish()
        offer = _weight_offer(config, setup, self.trainer, workdir, context) if self._offers() else None
        # The store has the version (the slices fetch it and warm up meanwhile): compile every train-step
        # shape before the coordinator hears of it, so no step compiles while the run is timed.
        widths = trainer_role.warmup(config, self.trainer)
        if widths:
            log.info("compiled the train step for micro-batch lengths %s", widths)
        before = functools.partial(_offer, offer, self.trainer) if offer else None
        self.report = _reporter(self.client, self.store, before) if self.leader else _report_nothing
        self.report(self.trainer.version)
        log.info("published version %d to %s", self.trainer.version, context.versions_root)
        self.source = _BatchSource(self.client, self.channel, self.report, context.poll_s)
        if self.leader:
            self.writer = trainer_role.open_writer(config, workdir, context.config_json)
            self.evaluation, self.evaluator = _evaluator(config, setup, self.client, workdir, self.writer)
            self.evaluator.maybe_request(self.trainer.version)

    def _register(self) -> bool:
        """Host 0 joins the run; returns whether it resumes (every host hears it: orbax restores
        collectively)."""

        resuming = False
        if self.leader:
            resuming = self.client.register(pb.TRAINER, self.context.identity_hash, host_id=0).resume
            log.info("registered with the coordinator at %s; building the setup", self.client.address)
        if self.channel is not None:
            resuming = self.channel.exchange(b"resume" if resuming else None) == b"resume"
        return resuming

    def _offers(self) -> bool:
        """Whether versions also go device to device (host 0 of a one-host trainer, when asked)."""
        return self.leader and self.channel is None and self.config.rollout.weights_transfer

    def run(self, start: float) -> None:
        """Trains to `num_steps` (or a stop), then checkpoints a stop or waits for the last round."""
        config, trainer = self.config, self.trainer
        try:
            self._steps(start)
            if trainer.version < config.num_steps:
                if self.checkpoints.last_saved != trainer.version:
                    self.checkpoints.save()  # stopped between scheduled checkpoints
            else:
                trainer_role.finish_evaluation(self.evaluator, config.eval.final_timeout_s)
        except BaseException:
            self.source.abort()
            raise
        finally:
            self._close()

    def _steps(self, start: float) -> None:
        """The training loop; a lost coordinator is joined again from the newest checkpoint."""

        stop = self.stop
        while True:
            try:
                training_loop.train(
                    self.trainer,
                    self.source,
                    **training_loop.sizes(self.config, self.setup.tokenizer.pad_id),
                    writer=self.writer,
                    after_step=trainer_role.AfterStep(self.evaluator, self.checkpoints.after_step),
                    on_row=self._on_row,
                    start=start,
                    should_stop=stop.is_set if stop is not None and self.channel is None else None,
                )
                return
            except (SessionLost, CoordinatorUnreachable) as err:
                if self.channel is not None or not self.checkpoints.steps():
                    raise  # a multi-host trainer, or nothing to go back to: the job is relaunched
                log.info("lost the coordinator (%s); joining again to resume from the newest checkpoint", err)
                _rejoin(self.client, self.store, self.trainer, self.checkpoints, self.context.identity_hash)
                self.report(self.trainer.version)

    def _on_row(self, row: dict) -> None:
        if self.leader:
            log.info(
                "step %d/%d reward %.3f staleness %s versions in flight %s",
                self.trainer.version,
                self.config.num_steps,
                row["reward_mean"],
                row["staleness_max"],
                row["versions_in_flight"],
            )

    def _close(self) -> None:
        if self.evaluation is not None:
            self.evaluation.close()
        if self.writer is not None:
            trainer_role.close_writer(self.writer, self.workdir)
        self.checkpoints.close()
        try:
            self.store.flush()  # the last version durable before the coordinator stops the slices
        except OSError as err:
            log.info("%s", err)


def _report_nothing(version: int, behaviour_digests=None) -> None:
    """Hosts 1.. of a multi-host trainer: host 0 reports."""


def _trainer_mesh(config):

    try:
        return sharding.make_mesh(jax.devices(), dict(config.mesh.trainer))
    except ValueError as err:
        raise SystemExit(
            f"mesh.trainer={dict(config.mesh.trainer)} over {jax.process_count()} host(s): {err}"
        ) from None


def _weight_offer(config, setup, trainer, workdir: str, context: Context):
    """Every version offered device to device (dora_jax/transport/weights.py), or None: the slices
    read the tensorstore tier, as without the option."""

    try:
        offer = WeightOffer(
            jax.devices(),
            dict(config.mesh.rollout),
            setup.axes,
            trainer.serve_dtype,
            config.rollout.num_slices,
            workdir,
            keep_versions=config.coordinator.k_max + 2,  # a slice loads a version within C3's window
            host=context.transfer_host,
            port=context.transfer_port,
        )
    except Exception as err:
        log.info("no transfer server (%s: %s); versions go through the tensorstore tier only", type(err).__name__, err)
        return None
    log.info("offering every version device to device at %s", offer.address)
    return offer


def _evaluator(config, setup, client, workdir: str, writer):
    """(the port, the Evaluator) of host 0: rounds asked over gRPC (`Evaluate`), the rows
    written here. The trainer's copy of the held-out prompts gives the responses' prompts text."""

    held_out = coordinator_role.held_out_prompts(config, setup.task, setup.tokenizer)
    evaluation = RemoteEvaluation(client)
    decode = setup.tokenizer.decode
    # Leaks: None: the training prompts are drawn at the coordinator, whose rounds count them.
    evaluator = Evaluator(config.eval, config.num_steps, held_out, None, evaluation, decode, workdir, writer)
    return evaluation, evaluator


def _rejoin(client, store, trainer, checkpoints, identity_hash: str) -> None:
    """A restarted coordinator: register again (it finds the ledger and asks for a resume), go
    back to the newest checkpoint and publish its versions again."""

    if not client.register(pb.TRAINER, identity_hash, host_id=0).resume:
        raise SystemExit("the coordinator answering now is not resuming this run; stopping")
    store.rollback_to(-1)  # versions after the checkpoint are trained again, maybe differently
    if not checkpoints.restore():
        raise SystemExit("no checkpoint restores: relaunch the job (it starts over)")
    trainer.publish()


class _Checkpoints:
    """The trainer role's run checkpoints (dora_jax.runtime.roles.trainer). Host 0 gets the
    coordinator's state from its `Snapshot`; every host saves and restores its shards."""

    def __init__(self, config, workdir: str, trainer, store, setup, client, channel):

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

        restored = trainer_role.restore(self._checkpointer, self._trainer, self._store, self._fingerprint)
        state = trainer_role.coordinator_state(restored)
        start = self._trainer.version
        if self._client is not None:
            trainer_role.trim_rows(self._workdir, start)
            request = pb.ResumeRequest(
                session=self._client.session, has_state=state is not None, state_json=json.dumps(state or {})
            )
            self._client.call("Resume", lambda t: self._client.stub.Resume(request, timeout=t))
            said = f"resumed from the checkpoint of step {start}" if state else "no checkpoint restores: starting over"
            log.info(said)
        return state is not None

    def after_step(self, step: int) -> dict:
        if not self._every or (step + 1) % self._every:
            return {}
        return self.save()

    def save(self) -> dict:
        """A checkpoint of the trainer's state now, with the coordinator's from its Snapshot."""

        trainer, t0 = self._trainer, time.perf_counter()
        meta = None
        if self._client is not None:
            try:
                meta = self._meta()
            except Exception as err:  # the run goes on; the previous checkpoint stays in use
                log.info("no checkpoint at step %d: %s", trainer.version, err)
        if self._channel is not None:
            meta = json.loads(self._channel.exchange(json.dumps(meta).encode() if self._channel.is_leader else None))
        if meta is None:
            return {"checkpoint_error": 1}
        try:
            trainer_role.save(self._checkpointer, trainer, self._store, meta)
        except CheckpointError as err:
            log.info("%s; the previous checkpoint stays in use", err)
            return {"checkpoint_error": 1}
        self.last_saved = trainer.version
        return {"checkpoint_s": time.perf_counter() - t0}

    def _meta(self) -> dict:

        version = self._trainer.version
        request = pb.SnapshotRequest(session=self._client.session, trainer_version=version)
        reply = self._client.call("Snapshot", lambda t: self._client.stub.Snapshot(request, timeout=t))
        return trainer_role.checkpoint_meta(json.loads(reply.state_json), version, self._fingerprint)

    def close(self) -> None:

        try:
            self._checkpointer.close()
        except CheckpointError as err:
            log.info("%s", err)


def _host_channel(context: Context):

    check_same_slice(
        {
            "config_hash": context.identity_hash,
            "package_version": dora_jax.__version__,
            "role": "trainer",
            "num_hosts": jax.process_count(),
        }
    )
    return HostChannel()


def _setup_and_store(config, workdir: str, channel, mesh, root: str):
    """The run's setup (a HF checkpoint read straight into `mesh`'s shardings) and the ParamStore,
    emptied of an earlier run's versions.

    Several hosts: host 0 builds the setup first (the SFT cold start, if any, runs on its own
    devices and is cached in WORKDIR/sft, which the trainer's hosts must share) and clears the
    versions root; then the other hosts build theirs (reading that cache) and open the root.
    """

    # The SFT cold start carves its trainer mesh out of the embedded run's device split; this
    # process holds only the trainer's devices, so the rollout slices may overlap them there
    # (time_shared). On several hosts host 0 trains it alone, on its local devices (the first
    # ones of jax.devices()), so that the others need not take part in it.
    sft_mesh = dataclasses.replace(config.mesh, time_shared=True)
    if channel is not None:
        sft_mesh = dataclasses.replace(sft_mesh, trainer=(("fsdp", jax.local_device_count()),))
    sft_view = dataclasses.replace(config, mesh=sft_mesh)

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

    def __init__(self, client, channel, report, poll_s: float):
        self._client, self._channel, self._report = client, channel, report
        self._poll_s = poll_s

    def take(self, version: int, ahead=None, committed: bool = False):
        if self._client is not None:
            reply = _take_batch(self._client, version, self._poll_s, ahead, committed)
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
        log.info("version %d not offered device to device (%s: %s); the tier has it", version, type(err).__name__, err)


def _reporter(client, store, before=None):
    """Host 0 reports each publish and retires the versions the coordinator no longer needs;
    `before(version)` runs first (the device-to-device offer, before any slice is told to load)."""

    def report(version: int, behaviour_digests=None) -> None:
        if before is not None:
            before(version)
        request = pb.PublishedRequest(
            session=client.session, version=version, behaviour_digests=behaviour_digests or {}
        )
        reply = client.call("ReportPublished", lambda t: client.stub.ReportPublished(request, timeout=t))
        store.retire_below(min(int(reply.oldest_needed), version))

    return report


def _take_batch(client, version: int, poll_s: float, ahead=None, committed: bool = False):
    """Long-polls until the coordinator hands over the batch for `version` (a TakeBatchReply).
    With `ahead` (trainer.score_ahead), the polls also return finished samples the trainer will
    train on, each once (Coordinator.peek_batch), and `ahead` gets them; `committed`
    (trainer.grad_ahead): only whole groups the coordinator commits to the batch."""
    request = pb.TakeBatchRequest(
        session=client.session, trainer_version=version, wait_s=poll_s, peek=ahead is not None, commit=committed
    )
    while True:
        reply = client.call(
            "TakeBatch",
            lambda t: client.stub.TakeBatch(request, timeout=t),
            timeout_s=poll_s + client.timing.call_timeout_s,
        )
        if reply.ready:
            return reply
        if ahead is not None and reply.groups:
            ahead([codec.group_from_proto(g) for g in reply.groups])
