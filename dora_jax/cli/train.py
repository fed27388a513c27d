"""`python -m dora_jax.train --config=configs/smoke.py --workdir=DIR [--config.mode=sync ...]`

Runs the whole system in one process on the local devices (dora_jax.runtime.runner), then audits the
ledger, plots the reward curve to WORKDIR/reward_curve.png and prints the summary. Exits
non-zero if the audit finds a violation the mode promises.

Run it again on the same workdir to resume (from the newest checkpoint that restores). SIGTERM
(a preemption notice) stops at the next step boundary with a checkpoint and exits with 75:
rerun the same command to continue.
"""

from __future__ import annotations

import json
import signal
import sys
import threading

from absl import app

from dora_jax import cli


def main(argv):
    del argv
    cli.prepare_devices(cli.CONFIG.value)
    from dora_jax.runtime import run_config, runner

    if not cli.WORKDIR.value:
        raise app.UsageError("--workdir is required")
    config = run_config.parse(cli.CONFIG.value)
    preempt = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: preempt.set())
    result = runner.run(config, cli.WORKDIR.value, write_config=cli.config_as_json(cli.CONFIG.value), preempt=preempt)
    summary = result.audit.summary()
    from dora_jax.runtime.metrics import read_metrics

    rows = read_metrics(result.workdir)  # every step of the run, resumed ones included
    evals = [r for r in rows if "eval/reward_greedy" in r]
    rows = [r for r in rows if "reward_mean" in r]
    print(
        json.dumps(
            {
                "workdir": result.workdir,
                "mode": config.mode,
                "steps": result.steps,
                "wall_s": round(result.wall_s, 2),
                "reward_first3": _mean(r["reward_mean"] for r in rows[:3]),
                "reward_last3": _mean(r["reward_mean"] for r in rows[-3:]),
                "eval": {
                    "steps": [r["step"] for r in evals],
                    "reward_greedy": [_mean([r["eval/reward_greedy"]]) for r in evals],
                    **{
                        k: [_mean([r.get(k)]) for r in evals]
                        for k in sorted({k for r in evals for k in r})
                        if "pass@" in k
                    },
                    "wall_s": round(sum(r["eval/wall_s"] for r in evals), 2),
                    "leaked_train_prompts": evals[-1]["eval/leaked_train_prompts"] if evals else 0,
                }
                if evals
                else None,
                "resumed_from": result.resumed_from,
                "preempted": result.preempted,
                "checkpoint_errors": result.checkpoint_errors,
                "audit_ok": result.audit.ok,
                "violations": result.audit.violations(),
                "max_staleness": summary["max_staleness"],
                "max_versions_in_flight": summary["max_versions_in_flight"],
                "migrations_kv": summary["migrations_kv"],
                "trainer_wait_s": round(result.coordinator_stats["trainer_wait_s"], 2),
                "reward_curve": result.reward_curve,
            }
        )
    )
    sys.exit(1 if not result.audit.ok else 75 if result.preempted else 0)


def _mean(values):
    values = [v for v in values if v is not None and v == v]
    return round(sum(values) / len(values), 4) if values else None


def run() -> None:
    """The `python -m dora_jax.train` entry point."""
    app.run(main)


if __name__ == "__main__":
    run()
