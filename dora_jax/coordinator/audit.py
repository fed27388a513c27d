"""The invariant auditor: reads a ledger and reports C1, C2, C3 and exactly-once.

It trusts nothing the run says about itself except the events: versions_seen comes from the
workers' per-token versions, staleness from consume vs dispatch versions.

  C1 every finished trajectory's versions_seen == [its dispatch version]; every migration lands
     on a slice serving that version.
  C2 nothing sampled is dropped: every finished trajectory is consumed, or still queued at the end.
  C3 every consume has trainer_version - version <= k_max (0 for sync, 1 for one_step_off).
  exactly once: no trajectory is consumed twice, none consumed without a dispatch and a finish.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterable

from dora_jax.modes import policy_for


@dataclasses.dataclass
class AuditReport:
    mode: str = "?"
    k_max: int = 0
    dispatched: int = 0
    finished: int = 0
    consumed: int = 0
    in_flight_at_end: int = 0
    unconsumed_finished_at_end: int = 0
    redispatched: int = 0
    migrations_kv: int = 0
    migrations_no_kv: int = 0
    publishes: int = 0
    resumes: int = 0
    voided_events: int = 0
    max_versions_in_flight: int = 0
    staleness_histogram: dict = dataclasses.field(default_factory=dict)
    c1_violations: list = dataclasses.field(default_factory=list)
    c2_violations: list = dataclasses.field(default_factory=list)
    c3_violations: list = dataclasses.field(default_factory=list)
    exactly_once_violations: list = dataclasses.field(default_factory=list)

    @property
    def max_staleness(self) -> int:
        return max(self.staleness_histogram, default=0)

    def violations(self) -> dict[str, int]:
        """Violation counts of what the run's mode promises (partial_rollout does not promise C1)."""
        out = {
            "C2": len(self.c2_violations),
            "C3": len(self.c3_violations),
            "exactly_once": len(self.exactly_once_violations),
        }
        if self.mode == "?" or policy_for(self.mode).keeps_c1:
            out["C1"] = len(self.c1_violations)
        return out

    @property
    def ok(self) -> bool:
        return not any(self.violations().values())

    def summary(self) -> dict:
        data = dataclasses.asdict(self)
        for key in ("c1_violations", "c2_violations", "c3_violations", "exactly_once_violations"):
            data[key] = {"count": len(data[key]), "first": data[key][:3]}
        data["staleness_histogram"] = {str(k): v for k, v in sorted(self.staleness_histogram.items())}
        data["max_staleness"] = self.max_staleness
        data["ok"] = self.ok
        return data


def effective_events(events: Iterable[dict]) -> tuple[list[dict], int]:
    """Applies `resume` events: lines between a resume's ledger_offset and the resume are void."""
    kept: list[dict] = []
    position = 0  # complete lines seen so far, voided ones included
    line_of: list[int] = []
    voided = 0
    for event in events:
        if event["ev"] == "resume":
            offset = int(event["ledger_offset"])
            while line_of and line_of[-1] >= offset:
                line_of.pop()
                kept.pop()
                voided += 1
        kept.append(event)
        line_of.append(position)
        position += 1
    return kept, voided


def audit(events: Iterable[dict], *, mode: str | None = None, k_max: int | None = None) -> AuditReport:
    events, voided = effective_events(events)
    report = AuditReport(voided_events=voided)
    for event in events:
        if event["ev"] == "run":
            report.mode, report.k_max = event["mode"], int(event["k_max"])
    report.mode = mode or report.mode
    report.k_max = report.k_max if k_max is None else k_max
    bound = _staleness_bound(report)

    version_of: dict[str, int] = {}
    slice_version: dict[int, int] = {}
    in_flight: dict[str, int] = {}
    finished: set[str] = set()
    consumed: set[str] = set()
    staleness = collections.Counter()
    for event in events:
        ev = event["ev"]
        if ev == "resume":
            report.resumes += 1
        elif ev == "load_version":
            slice_version[event["slice"]] = event["version"]
        elif ev == "dispatch":
            traj = event["traj"]
            if traj in version_of:
                report.redispatched += 1
                if version_of[traj] != event["version"]:
                    report.c1_violations.append(f"{traj}: re-dispatched under version {event['version']}, first {version_of[traj]}")
            else:
                report.dispatched += 1
            version_of[traj] = event["version"]
            if traj not in finished:
                in_flight[traj] = event["version"]
            report.max_versions_in_flight = max(report.max_versions_in_flight, len(set(in_flight.values())))
        elif ev == "migrate":
            report.migrations_kv += bool(event["kv"])
            report.migrations_no_kv += not event["kv"]
            dest_version = slice_version.get(event["to"])
            if dest_version is not None and dest_version != event["version"]:
                report.c1_violations.append(f"{event['traj']}: migrated to slice {event['to']} serving v{dest_version}")
        elif ev == "finish":
            traj = event["traj"]
            if traj not in version_of:
                report.exactly_once_violations.append(f"{traj}: finished but never dispatched")
                continue
            if traj in finished:
                report.exactly_once_violations.append(f"{traj}: finished twice")
            finished.add(traj)
            in_flight.pop(traj, None)
            report.finished += 1
            seen = sorted(set(event["versions_seen"]))
            if seen and seen != [version_of[traj]]:
                report.c1_violations.append(f"{traj}: dispatched as v{version_of[traj]} but sampled by {seen}")
        elif ev == "consume":
            traj = event["traj"]
            if traj in consumed:
                report.exactly_once_violations.append(f"{traj}: consumed twice")
            elif traj not in finished:
                report.exactly_once_violations.append(f"{traj}: consumed before it finished")
            consumed.add(traj)
            report.consumed += 1
            lag = int(event["trainer_version"]) - version_of.get(traj, event["trainer_version"])
            staleness[lag] += 1
            if lag < 0 or (bound is not None and lag > bound):
                report.c3_violations.append(f"{traj}: staleness {lag} > {bound} at step {event['step']}")
        elif ev == "publish":
            report.publishes += 1
        elif ev == "drop":
            report.c2_violations.append(f"{event['traj']}: dropped ({event.get('reason', '?')})")
    report.in_flight_at_end = len(in_flight)
    report.unconsumed_finished_at_end = len(finished - consumed)
    report.staleness_histogram = dict(staleness)
    return report


def _staleness_bound(report: AuditReport) -> int | None:
    if report.mode == "?":
        return report.k_max or None
    promised = policy_for(report.mode).max_staleness
    return report.k_max if promised is None else promised
