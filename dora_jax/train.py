"""`python -m dora_jax.train --config=configs/smoke.py --workdir=DIR [--config.mode=sync ...]`

Runs the whole system in one process on the local devices (dora_jax.runner), then audits the
ledger and prints the summary. Exits non-zero if the audit finds a violation the mode promises.
"""

from __future__ import annotations

import json
import sys

from absl import app

from dora_jax import cli


def main(argv):
    del argv
    cli.prepare_devices(cli.CONFIG.value)
    from dora_jax import run_config, runner

    if not cli.WORKDIR.value:
        raise app.UsageError("--workdir is required")
    config = run_config.parse(cli.CONFIG.value)
    result = runner.run(config, cli.WORKDIR.value, write_config=cli.config_as_json(cli.CONFIG.value))
    summary = result.audit.summary()
    last = result.metrics[-3:]
    print(json.dumps({
        "workdir": result.workdir, "mode": config.mode, "steps": result.steps, "wall_s": round(result.wall_s, 2),
        "reward_first3": _mean(r["reward_mean"] for r in result.metrics[:3]),
        "reward_last3": _mean(r["reward_mean"] for r in last),
        "audit_ok": result.audit.ok, "violations": result.audit.violations(),
        "max_staleness": summary["max_staleness"], "max_versions_in_flight": summary["max_versions_in_flight"],
        "migrations_kv": summary["migrations_kv"], "trainer_wait_s": round(result.coordinator_stats["trainer_wait_s"], 2),
    }))
    sys.exit(0 if result.audit.ok else 1)


def _mean(values):
    values = [v for v in values if v == v]
    return round(sum(values) / len(values), 4) if values else None


if __name__ == "__main__":
    app.run(main)
