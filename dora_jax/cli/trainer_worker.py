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

import signal
import threading

from absl import app, flags

from dora_jax import cli
from dora_jax.cli import roles

POLL_S = flags.DEFINE_float("poll_s", 10.0, "long-poll window of one TakeBatch call")


def main(argv):
    del argv
    roles.quiet_library_logs()
    roles.log_as("trainer")
    cli.prepare_devices(cli.CONFIG.value)
    host_id = roles.initialize_distributed("trainer")
    workdir = roles.require(cli.WORKDIR, "workdir")
    from dora_jax.runtime import run_config
    from dora_jax.runtime.placements.trainer_process import train

    config = run_config.parse(cli.CONFIG.value)
    context = _context(workdir)
    if host_id > 0:
        train(config, workdir, None, context)
        return
    address = roles.require(roles.COORDINATOR, "coordinator")
    from dora_jax.transport.client import CallFailed, Client, CoordinatorUnreachable, Refused, SessionLost

    client = Client(address, roles.client_timing(), roles.client_credentials())
    stop = threading.Event()  # SIGTERM (a preemption notice, `ray job stop`): checkpoint and exit 75
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        train(config, workdir, client, context, stop)
    except (CoordinatorUnreachable, Refused, SessionLost, CallFailed) as err:
        roles.fail(str(err))
    finally:
        client.close()


def _context(workdir: str):
    from dora_jax.runtime.placements.trainer_process import Context

    return Context(
        identity_hash=roles.identity_hash(),
        config_json=roles.config_json(),
        versions_root=roles.versions_root(workdir),
        transfer_host=roles.transfer_host(),
        transfer_port=roles.transfer_port(),
        poll_s=POLL_S.value,
    )


def run() -> None:
    """The `python -m dora_jax.trainer_worker` entry point."""
    app.run(main)


if __name__ == "__main__":
    run()
