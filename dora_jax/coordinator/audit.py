"""The invariant auditor: reads a ledger and reports C1, C2, C3, exactly-once and the weights.

It trusts nothing the run says about itself except the events: versions_seen comes from the
workers' per-token versions, staleness from consume vs dispatch versions, a slice's version from
its last `load_version`.

  C1 every finished trajectory's versions_seen == [its dispatch version]; a re-dispatch keeps the
     version; every dispatch and every migration lands on a slice whose last `load_version` is the
     request's version (a failed, joined or resumed slice has none until it loads again).
  C2 nothing sampled is dropped: no `drop` event, and no unconsumed sample is stranded: once the
     trainer has consumed at version T, a sample of version v can only be trained at T+1 or later,
     so v + bound < T + 1 means it can never be trained legally.
  C3 every consume has trainer_version - version <= bound (k_max; 0 for sync, 1 for
     one_step_off), with version the sample's dispatch version, and every consumed group is of
     one version (the one its consume events state).
  exactly once: no trajectory is consumed twice, none consumed without a dispatch and a finish.
  weights: every `load_version`, every `behaviour` record (the params the trainer used to
     recompute behaviour log-probs) and every consume whose behaviour log-probs a rollout slice
     scored (`"behaviour": "rollout"` with the scoring params' `behaviour_digest`) of one version
     carry the same params digest. Consumes count by where their behaviour log-probs came from
     (`behaviour_rollout`, `behaviour_trainer`, `behaviour_sampler`); a rollout-scored one without
     a digest is a weights violation. A row whose behaviour log-probs are its own sampling
     log-probs (`"behaviour": "sampler"`) was sampled by the params its slices loaded, whose
     digests the `load_version` records carry (and C1 holds it to its version's).
  evaluation: requests dispatched with `"eval": true` (dora_jax.coordinator.evaluation) are held
     to C1 like any other, are counted apart (`eval_dispatched`, `eval_finished`,
     `eval_unfinished_at_end`: not C2 losses, they were never for training), and an evaluation
     trajectory that is consumed is an exactly-once violation (it must never be trained on).
  dynamic sampling: a `filtered` group's samples (dora_jax.coordinator.dynamic_sampling) are
     accounted for, as consumed ones are (never stranded, C2); filtering is terminal, so a
     filtered sample that is consumed, or filtered twice, or before it finished, breaks exactly
     once. From the `score` events (every completed group's rewards and which count), with the
     run's `dynamic_sampling` on, every consumed group must have reward variance and every
     filtered one none; with it off nothing may be filtered.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

from dora_jax.coordinator.dynamic_sampling import why_uninformative
from dora_jax.core.modes import policy_for


@dataclasses.dataclass
class AuditReport:
    mode: str = "?"
    k_max: int = 0
    dynamic_sampling: bool = False  # the run's header says groups without reward variance are filtered
    dispatched: int = 0
    finished: int = 0
    consumed: int = 0
    in_flight_at_end: int = 0
    unconsumed_finished_at_end: int = 0
    redispatched: int = 0
    migrations_kv: int = 0
    migrations_reprefill: int = 0  # of migrations_no_kv: admitted requests re-prefilled at the destination
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
    weights_violations: list = dataclasses.field(default_factory=list)
    stranded: int = 0  # unconsumed samples that can no longer be trained (counted in C2)
    eval_dispatched: int = 0
    eval_finished: int = 0
    eval_unfinished_at_end: int = 0  # evaluation requests lost (a preemption) or cut off by the run's end
    evaluations: list = dataclasses.field(default_factory=list)  # each `eval` event's summary
    scored_groups: int = 0  # `score` events: completed training groups with their rewards
    filtered: int = 0  # samples filtered by dynamic sampling (accounted for: never trained on, not lost)
    filtered_groups: int = 0
    dynamic_sampling_violations: list = dataclasses.field(default_factory=list)
    behaviour_rollout: int = 0  # consumed rows whose behaviour log-probs their rollout slice scored
    behaviour_trainer: int = 0  # consumed rows whose behaviour log-probs the trainer computed
    behaviour_sampler: int = 0  # consumed rows whose behaviour log-probs are the engine's sampling log-probs

    @property
    def max_staleness(self) -> int:
        return max(self.staleness_histogram, default=0)

    def violations(self) -> dict[str, int]:
        """Violation counts of what the run's mode promises (partial_rollout does not promise C1)."""
        out = {
            "C2": len(self.c2_violations),
            "C3": len(self.c3_violations),
            "exactly_once": len(self.exactly_once_violations),
            "weights": len(self.weights_violations),
            "dynamic_sampling": len(self.dynamic_sampling_violations),
        }
        if self.mode == "?" or policy_for(self.mode).keeps_c1:
            out["C1"] = len(self.c1_violations)
        return out

    @property
    def ok(self) -> bool:
        return not any(self.violations().values())

    def summary(self) -> dict:
        data = dataclasses.asdict(self)
        for key in (
            "c1_violations",
            "c2_violations",
            "c3_violations",
            "exactly_once_violations",
            "weights_violations",
            "dynamic_sampling_violations",
        ):
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
            report.dynamic_sampling = bool(event.get("dynamic_sampling", False))
    report.mode = mode or report.mode
    report.k_max = report.k_max if k_max is None else k_max
    walk = _Walk(report, _staleness_bound(report))
    for event in events:
        handler = getattr(walk, "on_" + event["ev"], None)
        if handler is not None:
            handler(event)
    walk.finish()
    return report


class _Walk:
    """The auditor's state while it reads the ledger in order; one handler per event kind."""

    def __init__(self, report: AuditReport, bound: int | None):
        self.report, self.bound = report, bound
        self.version_of: dict[str, int] = {}  # dispatch version per trajectory
        self.slice_version: dict[int, int] = {}  # last load_version per live slice
        self.in_flight: dict[str, int] = {}
        self.in_flight_versions = collections.Counter()  # version -> trajectories in flight
        self.finished: set[str] = set()
        self.consumed: set[str] = set()
        self.group_version: dict[str, int] = {}  # version of each consumed group
        self.digests: dict[int, dict[str, str]] = collections.defaultdict(dict)  # version -> digest -> first seen
        self.trained_at = -1  # newest trainer version that consumed
        self.eval_trajs: set[str] = set()
        self.staleness = collections.Counter()
        self.scores: dict[str, str | None] = {}  # scored group -> why it has no reward variance (None: it has)
        self.filtered: set[str] = set()

    def on_resume(self, event: dict) -> None:
        self.report.resumes += 1
        self.slice_version.clear()  # slices start over with nothing loaded

    def on_load_version(self, event: dict) -> None:
        self.slice_version[event["slice"]] = event["version"]
        if "digest" in event:
            self._digest(event["version"], event["digest"], f"slice {event['slice']} loaded")

    def on_slice_failed(self, event: dict) -> None:
        self.slice_version.pop(event["slice"], None)

    on_slice_joined = on_slice_failed

    def on_behaviour(self, event: dict) -> None:
        for version, digest in event["digests"].items():
            self._digest(int(version), digest, f"trainer at step {event['step']} recomputed with")

    def _digest(self, version: int, digest: str, who: str) -> None:
        seen = self.digests[version]
        if seen and digest not in seen:
            first, first_who = next(iter(seen.items()))
            self.report.weights_violations.append(
                f"version {version}: {who} params {digest}, but {first_who} params {first}"
            )
        seen.setdefault(digest, who)

    def on_dispatch(self, event: dict) -> None:
        report, traj, version = self.report, event["traj"], event["version"]
        if traj in self.version_of:
            report.redispatched += 1
            if self.version_of[traj] != version:
                report.c1_violations.append(
                    f"{traj}: re-dispatched under version {version}, first {self.version_of[traj]}"
                )
        else:
            self.version_of[traj] = version
            if event.get("eval"):
                self.eval_trajs.add(traj)
                report.eval_dispatched += 1
            else:
                report.dispatched += 1
        self._lands(traj, version, event["slice"], "dispatched")
        if traj not in self.finished:
            self._leaves(traj)
            self.in_flight[traj] = version
            self.in_flight_versions[version] += 1
        report.max_versions_in_flight = max(report.max_versions_in_flight, len(self.in_flight_versions))

    def _leaves(self, traj: str) -> None:
        version = self.in_flight.pop(traj, None)
        if version is not None:
            self.in_flight_versions[version] -= 1
            if not self.in_flight_versions[version]:
                del self.in_flight_versions[version]

    def _lands(self, traj: str, version: int, slice_id: int, how: str) -> None:
        serving = self.slice_version.get(slice_id)
        if serving != version:
            serves = "nothing loaded" if serving is None else f"v{serving}"
            self.report.c1_violations.append(f"{traj} (v{version}): {how} to slice {slice_id} serving {serves}")

    def on_migrate(self, event: dict) -> None:
        self.report.migrations_kv += bool(event["kv"])
        self.report.migrations_no_kv += not event["kv"]
        self.report.migrations_reprefill += event.get("how") == "reprefill"
        self._lands(event["traj"], event["version"], event["to"], "migrated")

    def on_finish(self, event: dict) -> None:
        report, traj = self.report, event["traj"]
        if traj not in self.version_of:
            report.exactly_once_violations.append(f"{traj}: finished but never dispatched")
            return
        if traj in self.finished:
            report.exactly_once_violations.append(f"{traj}: finished twice")
        self.finished.add(traj)
        self._leaves(traj)
        if traj in self.eval_trajs:
            report.eval_finished += 1
        else:
            report.finished += 1
        seen = sorted(set(event["versions_seen"]))
        if seen and seen != [self.version_of[traj]]:
            report.c1_violations.append(f"{traj}: dispatched as v{self.version_of[traj]} but sampled by {seen}")

    def on_consume(self, event: dict) -> None:
        report, traj, trainer_version = self.report, event["traj"], int(event["trainer_version"])
        if traj in self.eval_trajs:
            report.exactly_once_violations.append(f"{traj}: an evaluation trajectory was trained on")
        if traj in self.consumed:
            report.exactly_once_violations.append(f"{traj}: consumed twice")
        elif traj not in self.finished:
            report.exactly_once_violations.append(f"{traj}: consumed before it finished")
        if traj in self.filtered:
            report.exactly_once_violations.append(f"{traj}: consumed after it was filtered")
        self.consumed.add(traj)
        self._leaves(traj)
        report.consumed += 1
        self.trained_at = max(self.trained_at, trainer_version)
        version = self.version_of.get(traj, trainer_version)
        lag = trainer_version - version
        self.staleness[lag] += 1
        if lag < 0 or (self.bound is not None and lag > self.bound):
            report.c3_violations.append(f"{traj}: staleness {lag} > {self.bound} at step {event['step']}")
        if "version" in event and int(event["version"]) != version:
            report.c3_violations.append(f"{traj}: consumed as v{event['version']} but dispatched as v{version}")
        self._behaviour_source(event, version)
        if "group" in event:
            group_version = self.group_version.setdefault(event["group"], version)
            if group_version != version:
                report.c3_violations.append(f"{traj}: group {event['group']} mixes v{group_version} and v{version}")

    def _behaviour_source(self, event: dict, version: int) -> None:
        """Counts where a consumed row's behaviour log-probs came from; a slice-scored row's digest
        must be its version's."""
        if event.get("behaviour") == "sampler":
            self.report.behaviour_sampler += 1
            return
        if event.get("behaviour") != "rollout":
            self.report.behaviour_trainer += 1
            return
        self.report.behaviour_rollout += 1
        digest = event.get("behaviour_digest")
        if not isinstance(digest, str):
            self.report.weights_violations.append(f"{event['traj']}: scored by a rollout slice with no params digest")
            return
        self._digest(version, digest, f"the slice that scored {event['traj']}")

    def on_publish(self, event: dict) -> None:
        self.report.publishes += 1

    def on_eval(self, event: dict) -> None:
        self.report.evaluations.append({k: v for k, v in event.items() if k not in ("ev", "t")})

    def on_score(self, event: dict) -> None:
        group = event["group"]
        if group in self.scores:
            self.report.exactly_once_violations.append(f"group {group}: scored twice")
        self.scores[group] = why_uninformative(event["rewards"], event["valid"])
        self.report.scored_groups += 1

    def on_filtered(self, event: dict) -> None:
        report, group = self.report, event["group"]
        report.filtered_groups += 1
        if not report.dynamic_sampling:
            report.dynamic_sampling_violations.append(f"group {group}: filtered, but the run has dynamic sampling off")
        if group not in self.scores:
            report.dynamic_sampling_violations.append(f"group {group}: filtered without a score")
        elif self.scores[group] is None:
            report.dynamic_sampling_violations.append(f"group {group}: filtered, but its rewards vary")
        for traj in event["trajs"]:
            if traj in self.filtered:
                report.exactly_once_violations.append(f"{traj}: filtered twice")
            elif traj in self.consumed:
                report.exactly_once_violations.append(f"{traj}: filtered after it was consumed")
            elif traj not in self.finished:
                report.exactly_once_violations.append(f"{traj}: filtered before it finished")
            self.filtered.add(traj)
            self._leaves(traj)
            report.filtered += 1

    def on_drop(self, event: dict) -> None:
        self.report.c2_violations.append(f"{event['traj']}: dropped ({event.get('reason', '?')})")

    def finish(self) -> None:
        report = self.report
        report.eval_unfinished_at_end = len(self.eval_trajs - self.finished)
        report.in_flight_at_end = len(self.in_flight) - len(self.eval_trajs & set(self.in_flight))
        report.unconsumed_finished_at_end = len(self.finished - self.consumed - self.eval_trajs - self.filtered)
        report.staleness_histogram = dict(self.staleness)
        if report.dynamic_sampling:
            for group in self.group_version:  # the consumed groups
                if group not in self.scores:
                    report.dynamic_sampling_violations.append(f"group {group}: consumed without a score")
                elif self.scores[group] is not None:
                    report.dynamic_sampling_violations.append(
                        f"group {group}: consumed with no reward variance ({self.scores[group]})"
                    )
        if self.bound is None or self.trained_at < 0:
            return
        for traj, version in self.version_of.items():
            done = traj in self.consumed or traj in self.eval_trajs or traj in self.filtered
            if not done and version + self.bound < self.trained_at + 1:
                report.stranded += 1
                report.c2_violations.append(
                    f"{traj} (v{version}): never consumed, and after the take at trainer version "
                    f"{self.trained_at} it can no longer be trained within staleness {self.bound}"
                )


def _staleness_bound(report: AuditReport) -> int | None:
    if report.mode == "?":
        return report.k_max or None
    promised = policy_for(report.mode).max_staleness
    return report.k_max if promised is None else promised
