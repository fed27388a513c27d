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

import dataclasses
import functools
import json
import logging
import os
import signal
import sys
import threading
import time

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
        code = serve(config, workdir, stop, trace=trace, security=security)
    sys.exit(code)


def _security(num_slices: int):
    """(Authenticator, TLS certificate or None) from the variables the launcher set; exits naming
    them when the secret is missing: the coordinator never serves without authentication."""
    from dora_jax.transport import auth

    try:
        return auth.Authenticator(auth.load_secret(os.environ), num_slices), auth.load_server_tls(os.environ)
    except (ValueError, OSError) as err:
        roles.fail(f"cannot serve: {err}")


def serve(config, workdir: str, stop: threading.Event, trace=None, security=(None, None)) -> int:
    """`trace`: (LengthDistribution, seed) for a trace-driven run (--trace_lengths), else None.
    `security`: (Authenticator, ServerTls or None), what `_security` read."""
    from dora_jax.coordinator.ledger import Ledger, repair_torn_tail
    from dora_jax.core import fs
    from dora_jax.runtime.build import make_tokenizer, vocab_size
    from dora_jax.runtime.roles import coordinator as coordinator_role
    from dora_jax.runtime.run_config import task_config
    from dora_jax.tasks.task import make_task

    ledger_path = fs.join(workdir, "ledger.jsonl")
    service, server = _start_service(config, fs.exists(ledger_path), security)
    tokenizer = make_tokenizer(config)
    pool_task = make_task(task_config(config), tokenizer)
    pool = pool_task.make_reward_pool(int(config.task.reward_workers), float(config.task.reward_timeout_s))
    held_out = coordinator_role.held_out_prompts(config, pool_task, tokenizer)  # what `Evaluate` answers
    if service.resume:
        repair_torn_tail(ledger_path)
        log.info("%s exists: resuming that run from the trainer's newest checkpoint", ledger_path)
    ledger = Ledger(ledger_path)
    coord, code = None, 0
    try:
        while not stop.is_set():  # one pass per generation: a restarted trainer starts the next one
            ports, version = _wait_ready(service, stop)
            if ports is None:
                return 0
            generation = service.generation
            # The prompt source and the prompts it handed out belong to one generation: a rewind
            # restores the source's position from the checkpoint (or starts it over).
            task = pool_task if generation == 0 else make_task(task_config(config), tokenizer)
            drawer = coordinator_role.PromptDrawer(task, held_out)
            scorer = _scorer(trace, pool, drawer, tokenizer)
            coord = coordinator_role.build(
                config,
                ports,
                drawer,
                scorer,
                ledger,
                vocab_size=vocab_size(config, tokenizer),
                initial_version=version,
                forced_length=_forced_length(trace),
                on_slice_dropped=service.slice_dropped,
            )
            if service.resume:
                state = service.resume_state or None  # {}: no checkpoint, the run starts over
                coordinator_role.restore(coord, drawer, state)
                log.info(f"restored the state of version {version}" if state else "no checkpoint: starting over")
            held = _held_out(config, held_out, drawer)
            service.attach(coord, list(ports.values()), snapshot_extra=drawer.snapshot_extra, held_out=held)
            log.info("all roles joined; dispatching from version %d", version)
            coord.start()
            if _serve_generation(coord, service, generation, stop):
                log.info("the trainer is done: stopping the rollout workers")
                return 0
            coord.closed = True  # a rewind: what it posts from now on is never handled
    except Exception as err:  # the run cannot go on: the trainer's next TakeBatch says so
        log.info("stopping: %s: %s", type(err).__name__, err)
        code = 1
    finally:
        _close(coord, service, server, ledger, pool)
    return code


def _start_service(config, resuming: bool, security):
    """The gRPC service, listening: (service, server)."""
    import dora_jax
    from dora_jax.transport.service import CoordinatorService, Identity, Timing, make_server

    identity = Identity(roles.identity_hash(), dora_jax.__version__, config.rollout.num_slices, config.rollout.slots)
    timing = Timing(
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S.value or config.rollout.heartbeat_timeout_s,
        command_timeout_s=COMMAND_TIMEOUT_S.value,
        rejoin_timeout_s=REJOIN_TIMEOUT_S.value,
    )
    service = CoordinatorService(identity, timing, resume=resuming)
    authenticator, tls = security
    server, port = make_server(service, cli.flag_or(cli.PORT, 50051), host=HOST.value, auth=authenticator, tls=tls)
    log.info(
        f"listening on {HOST.value}:{port} ({'TLS' if tls else 'plaintext'}, role tokens "
        f"{'checked' if authenticator else 'NOT checked'}); waiting for {config.rollout.num_slices} rollout "
        "slices and the trainer"
    )
    return service, server


def _scorer(trace, pool, drawer, tokenizer):
    """A trace-driven run's constant reward, or the reward pool grading against the drawer's prompts."""
    from dora_jax.coordinator.trace import ConstantScorer
    from dora_jax.tasks.reward_scorer import RewardPoolScorer

    return ConstantScorer() if trace else RewardPoolScorer(pool, drawer.book, tokenizer.decode)


def _forced_length(trace):
    """A trace-driven run's drawn response length per (prompt id, sample), or None."""
    if trace is None:
        return None
    lengths, seed = trace
    return functools.partial(_draw_length, lengths, seed)


def _draw_length(lengths, seed: int, prompt_id: str, index: int) -> int:
    return lengths.draw(prompt_id, index, seed)


def _held_out(config, held_out, drawer):
    """What `Evaluate` evaluates (None when the run does not evaluate); the leak counts come from
    this generation's drawer."""
    from dora_jax.transport.service import HeldOut

    if not held_out:
        return None
    return HeldOut(tuple((p.prompt_id, tuple(p.prompt_ids)) for p in held_out), config.eval.samples, drawer.leak_counts)


def _close(coord, service, server, ledger, pool) -> None:
    if coord is not None:
        coord.closed = True
        log.info("stats %s", json.dumps(_stats(coord, service)))
    service.stop("the run is over")
    time.sleep(0.5)  # let the Stop commands reach the workers
    server.stop(grace=2).wait()
    ledger.close()
    pool.close()


def _serve_generation(coord, service, generation: int, stop: threading.Event) -> bool:
    """Runs `coord` until the trainer is done (True), or a stop or a rewind (False). A restarted
    trainer's rewind fails every rollout port, possibly while `coord` is calling one (the lock is
    released across a call): the error that raises in this generation belongs to the run that was
    rewound, so it ends the generation, not the run."""
    from dora_jax.runtime.roles import coordinator as coordinator_role

    def running() -> bool:
        return not stop.is_set() and service.generation == generation and not service.finished.is_set()

    try:
        coordinator_role.serve(coord, running)
    except Exception as err:
        if service.generation == generation:
            raise
        log.info("generation %d ended by the rewind (%s: %s)", generation, type(err).__name__, err)
        return False
    return service.finished.is_set()


def _wait_ready(service, stop: threading.Event):
    deadline = time.monotonic() + START_TIMEOUT_S.value
    while not stop.is_set():
        try:
            return service.wait_ready(min(1.0, max(deadline - time.monotonic(), 0.0)))
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise
    return None, None


def _stats(coord, service) -> dict:
    stats = dataclasses.asdict(coord.stats)
    stats["slice_failures_seen"] = [f"slice {s}: {r}" for s, r in service.failures if r != "stopped"]
    return stats


def run() -> None:
    """The `python -m dora_jax.serve_coordinator` entry point."""
    app.run(main)


if __name__ == "__main__":
    run()
