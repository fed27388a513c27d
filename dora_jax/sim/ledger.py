"""Per-trajectory event log of a simulated run, and the auditor that checks it.

The log is columnar (one tuple per event) so that a paper-scale run stays cheap; `write_jsonl`
renders it in the project's ledger format. The auditor reads only the log, never the simulator's
state, and reports:
- C1: every token-producing segment (admit, migrate) of a trajectory ran on one version, equal to
  the version it was (last) dispatched with;
- C2 / exactly once: every consumed trajectory finished first and is consumed once; every
  dispatched trajectory is consumed or still live at the end (nothing dropped);
- C3: trainer_version - oldest version that produced its tokens <= the mode's staleness bound;
- group integrity: the G samples of a prompt are consumed in the same training step.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import json
from typing import Optional

import numpy as np


class Ev(enum.IntEnum):
    DISPATCH = 0  # (traj, prompt, version)
    ADMIT = 1  # (traj, version, group): a segment starts on a group serving `version`
    MIGRATE = 2  # (traj, version, src, dst): KV cache moves, no re-prefill
    INTERRUPT = 3  # (traj, version, group): partial rollout stops a request to re-prefill it later
    FINISH = 4  # (traj, tokens)
    CONSUME = 5  # (traj, step, trainer_version)
    PUBLISH = 6  # (version, step)
    LIVE_AT_END = 7  # (traj,): dispatched, not consumed when the run stopped


class EventLog:
    """Append-only list of (ev, t, a, b, c, d) tuples."""

    def __init__(self):
        self.events: list[tuple] = []

    def add(self, ev: Ev, t: float, a: int, b: int = -1, c: int = -1, d: int = -1) -> None:
        self.events.append((int(ev), t, a, b, c, d))

    def write_jsonl(self, path: str) -> None:
        fields = {
            Ev.DISPATCH: ("traj", "prompt", "version"),
            Ev.ADMIT: ("traj", "version", "slice"),
            Ev.MIGRATE: ("traj", "version", "from", "to"),
            Ev.INTERRUPT: ("traj", "version", "slice"),
            Ev.FINISH: ("traj", "tokens"),
            Ev.CONSUME: ("traj", "step", "trainer_version"),
            Ev.PUBLISH: ("version", "step"),
            Ev.LIVE_AT_END: ("traj",),
        }
        with open(path, "w") as f:
            for ev, t, *args in self.events:
                kind = Ev(ev)
                row = {"ev": kind.name.lower(), "t": round(t, 6)}
                row.update(zip(fields[kind], args))
                f.write(json.dumps(row) + "\n")


@dataclasses.dataclass(frozen=True)
class AuditReport:
    dispatched: int
    consumed: int
    live_at_end: int
    c1_violations: int  # trajectories whose tokens came from more than one version
    c2_violations: int  # dropped, consumed twice, or consumed before finishing
    c3_violations: int  # consumed with staleness above the bound
    group_violations: int  # prompts whose samples were split across training steps
    max_staleness: int
    staleness_hist: dict

    @property
    def ok(self) -> bool:
        return not (self.c1_violations or self.c2_violations or self.c3_violations or self.group_violations)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["ok"] = self.ok
        return d


def audit(log: EventLog, staleness_bound: int, samples_per_prompt: int) -> AuditReport:
    """Checks C1, C2 (exactly once), C3 and group integrity from the log alone."""
    ev = np.array([e[0] for e in log.events], dtype=np.int64)
    cols = np.array([e[2:] for e in log.events], dtype=np.int64).reshape(-1, 4)
    n_traj = int(cols[ev == Ev.DISPATCH, 0].max()) + 1 if np.any(ev == Ev.DISPATCH) else 0

    def rows(kind: Ev) -> np.ndarray:
        return cols[ev == kind]

    dispatch_version = np.full(n_traj, -1, dtype=np.int64)
    disp = rows(Ev.DISPATCH)
    dispatch_version[disp[:, 0]] = disp[:, 2]  # the last dispatch line wins (re-dispatch)
    prompt_of = np.full(n_traj, -1, dtype=np.int64)
    prompt_of[disp[:, 0]] = disp[:, 1]

    seg = np.concatenate([rows(Ev.ADMIT)[:, :2], rows(Ev.MIGRATE)[:, :2]])
    lo = np.full(n_traj, np.iinfo(np.int64).max, dtype=np.int64)
    hi = np.full(n_traj, -1, dtype=np.int64)
    np.minimum.at(lo, seg[:, 0], seg[:, 1])
    np.maximum.at(hi, seg[:, 0], seg[:, 1])
    has_seg = hi >= 0
    c1 = int(np.sum(has_seg & ((lo != hi) | (hi != dispatch_version))))

    finished = np.zeros(n_traj, dtype=bool)
    finished[rows(Ev.FINISH)[:, 0]] = True
    cons = rows(Ev.CONSUME)
    times_consumed = np.bincount(cons[:, 0], minlength=n_traj)
    live = np.zeros(n_traj, dtype=bool)
    live[rows(Ev.LIVE_AT_END)[:, 0]] = True
    consumed = times_consumed > 0
    c2 = int(
        np.sum(times_consumed > 1)
        + np.sum(consumed & ~finished)
        + np.sum(consumed & live)
        + np.sum(~consumed & ~live)  # dispatched, then vanished: dropped
    )

    staleness = cons[:, 2] - lo[cons[:, 0]]
    c3 = int(np.sum(staleness > staleness_bound))
    hist = collections.Counter(staleness.tolist())

    steps_per_prompt: dict[int, set] = collections.defaultdict(set)
    for traj, step in zip(cons[:, 0].tolist(), cons[:, 1].tolist()):
        steps_per_prompt[prompt_of[traj]].add(step)
    per_prompt = np.bincount(prompt_of[cons[:, 0]], minlength=1) if len(cons) else np.zeros(1)
    group_bad = sum(1 for s in steps_per_prompt.values() if len(s) > 1)
    group_bad += int(np.sum((per_prompt > 0) & (per_prompt != samples_per_prompt)))

    return AuditReport(
        dispatched=n_traj,
        consumed=int(consumed.sum()),
        live_at_end=int(live.sum()),
        c1_violations=c1,
        c2_violations=c2,
        c3_violations=c3,
        group_violations=group_bad,
        max_staleness=int(staleness.max()) if len(staleness) else 0,
        staleness_hist={int(k): int(v) for k, v in sorted(hist.items())},
    )


def consumed_tokens(log: EventLog) -> Optional[int]:
    """Response tokens of every consumed trajectory (a cross-check for the simulator's counters)."""
    tokens = {e[2]: e[3] for e in log.events if e[0] == Ev.FINISH}
    return sum(tokens[e[2]] for e in log.events if e[0] == Ev.CONSUME)
