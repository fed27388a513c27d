"""The process placement of the coordinator role: the same `Coordinator` as the embedded run
(dora_jax.runtime.roles.coordinator), its reward pool and ledger, behind the gRPC service
(dora_jax/transport/service.py). `python -m dora_jax.serve_coordinator`
(dora_jax.cli.serve_coordinator) parses the flags, takes the workdir's lease and calls `serve`.

It waits until every rollout slice has joined and the trainer has published its first version,
then dispatches. A workdir that already holds a ledger is resumed from the state the trainer hands
over (`Resume`); a trainer that registers while the run is going sends the run back to its
checkpoint: the next generation's coordinator is built from that state. It runs until the
trainer says it is done (`Finish`) or a stop, then tells the rollout workers to stop, and
writes its counters (`CoordinatorStats`) to WORKDIR/coordinator_stats.json.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
import time

import dora_jax
from dora_jax.coordinator.ledger import Ledger, repair_torn_tail
from dora_jax.coordinator.stats import STATS_FILE
from dora_jax.coordinator.trace import ConstantScorer
from dora_jax.core import fs
from dora_jax.runtime.build import make_tokenizer, vocab_size
from dora_jax.runtime.roles import coordinator as coordinator_role
from dora_jax.runtime.run_config import task_config
from dora_jax.tasks.reward_scorer import RewardPoolScorer
from dora_jax.tasks.task import make_task
from dora_jax.transport.service import CoordinatorService, HeldOut, Identity, Timing, make_server

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Context:
    """What the command line gives the coordinator process beside its config."""

    identity_hash: str  # the resolved config's digest: only this run's roles may join
    host: str = "[::]"  # the address to listen on
    port: int = 50051  # 0: any free port
    start_timeout_s: float = 3600.0  # how long every role may take to join
    heartbeat_timeout_s: float | None = None  # None: rollout.heartbeat_timeout_s of the config
    command_timeout_s: float = 600.0
    rejoin_timeout_s: float = 600.0


def serve(config, workdir: str, stop: threading.Event, context: Context, trace=None, security=(None, None)) -> int:
    """Serves the run until the trainer finishes (0), a stop (0) or an error (1). `trace`:
    (LengthDistribution, seed) for a trace-driven run (--trace_lengths), else None. `security`:
    (Authenticator, ServerTls or None): role tokens checked, TLS served."""

    ledger_path = fs.join(workdir, "ledger.jsonl")
    service, server = _start_service(config, fs.exists(ledger_path), security, context)
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
            ports, version = _wait_ready(service, stop, context.start_timeout_s)
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
        _close(coord, service, server, ledger, pool, workdir)
    return code


def _start_service(config, resuming: bool, security, context: Context):
    """The gRPC service, listening: (service, server)."""

    identity = Identity(context.identity_hash, dora_jax.__version__, config.rollout.num_slices, config.rollout.slots)
    timing = Timing(
        heartbeat_timeout_s=context.heartbeat_timeout_s or config.rollout.heartbeat_timeout_s,
        command_timeout_s=context.command_timeout_s,
        rejoin_timeout_s=context.rejoin_timeout_s,
    )
    service = CoordinatorService(identity, timing, resume=resuming)
    authenticator, tls = security
    server, port = make_server(service, context.port, host=context.host, auth=authenticator, tls=tls)
    log.info(
        f"listening on {context.host}:{port} ({'TLS' if tls else 'plaintext'}, role tokens "
        f"{'checked' if authenticator else 'NOT checked'}); waiting for {config.rollout.num_slices} rollout "
        "slices and the trainer"
    )
    return service, server


def _scorer(trace, pool, drawer, tokenizer):
    """A trace-driven run's constant reward, or the reward pool grading against the drawer's prompts."""

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

    if not held_out:
        return None
    return HeldOut(tuple((p.prompt_id, tuple(p.prompt_ids)) for p in held_out), config.eval.samples, drawer.leak_counts)


def _close(coord, service, server, ledger, pool, workdir: str) -> None:
    if coord is not None:
        coord.closed = True
        stats = json.dumps(_stats(coord, service))
        log.info("stats %s", stats)
        try:  # the same, for tools (bench modes reads the coordinator's port waits here)
            with fs.open(fs.join(workdir, STATS_FILE), "w", atomic=True) as f:
                f.write(stats)
        except OSError as err:  # the run is over; only this copy of the stats is lost
            log.info("could not write %s: %s", STATS_FILE, err)
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


def _wait_ready(service, stop: threading.Event, timeout_s: float):
    deadline = time.monotonic() + timeout_s
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
