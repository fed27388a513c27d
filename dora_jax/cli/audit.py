"""`python -m dora_jax.audit WORKDIR`: audits a run's ledger for C1, C2, C3 and exactly-once.

Prints a JSON summary (staleness histogram, versions concurrently in flight, migrations with and
without KV, evaluation rounds and dynamic sampling's filtered groups counted apart) and exits 1 on a
violation of what the run's mode promises.
"""

from __future__ import annotations

import json
import sys

from dora_jax.coordinator.audit import audit
from dora_jax.coordinator.ledger import read_ledger
from dora_jax.core import fs


def audit_workdir(workdir: str):
    """The audit of WORKDIR/ledger.jsonl (or of the ledger file given), local or on gs://."""
    fs.check_access(workdir)
    path = fs.join(workdir, "ledger.jsonl") if fs.isdir(workdir) else workdir
    if not fs.exists(path):
        raise FileNotFoundError(f"{path}: no ledger; expected WORKDIR/ledger.jsonl from a dora_jax run")
    return audit(read_ledger(path))


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] in ("-h", "--help"):
        print(f"usage: python -m dora_jax.audit WORKDIR|LEDGER.jsonl\n\n{__doc__}", file=sys.stderr)
        return 2
    try:
        report = audit_workdir(argv[1])
    except (FileNotFoundError, fs.StorageError) as err:
        print(f"dora_jax.audit: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report.summary(), indent=1))
    violations = report.violations()
    print(
        f"audit {'OK' if report.ok else 'FAILED'}: mode={report.mode} k_max={report.k_max} "
        f"violations={violations} max_staleness={report.max_staleness} "
        f"max_versions_in_flight={report.max_versions_in_flight} migrations_kv={report.migrations_kv} "
        f"migrations_reprefill={report.migrations_reprefill}"
    )
    if report.dynamic_sampling or report.filtered:
        print(
            f"dynamic sampling (filtered samples are accounted for, never trained on): {report.filtered_groups} of "
            f"{report.scored_groups} completed groups filtered ({report.filtered} samples)"
        )
    if report.eval_dispatched:
        greedy = [
            round(e["eval/reward_greedy"], 3) for e in report.evaluations if e.get("eval/reward_greedy") is not None
        ]
        print(
            f"evaluation (never trained on, not counted in C2): {len(report.evaluations)} rounds, "
            f"{report.eval_finished} of {report.eval_dispatched} requests finished, greedy reward by round {greedy}"
        )
    return 0 if report.ok else 1


def run() -> None:
    """The `python -m dora_jax.audit` entry point."""
    sys.exit(main(sys.argv))


if __name__ == "__main__":
    run()
