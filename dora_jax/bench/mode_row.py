"""One mode's figures from a finished run, however its roles ran (threads of one process or
`launch_local` jobs): busy intervals, the rollout-only share, the straggler and the take profile,
and the order the bench runs the modes in. Shared by `bench/modes.py` and `bench/disaggregated.py`."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

MODES = ("sync", "one_step_off", "partial_rollout", "dora")
# Mode variants, `MODE+VARIANT` in `bench.modes` (e.g. "dora+score_ahead"): the mode with these
# config fields changed, run side by side with the others; the ratios add VARIANT's against MODE.
VARIANTS = {
    "score_ahead": {"trainer.score_ahead": True},
    "rollout_scored": {"trainer.behaviour_logps": "rollout"},
    "sampler_logps": {"trainer.behaviour_logps": "sampler"},
    "grad_ahead": {"trainer.grad_ahead": True},
    "inline_calls": {"coordinator.apply_results_during_calls": False},
}


def split_mode(name: str) -> tuple[str, dict]:
    """'dora+score_ahead' -> ('dora', {'trainer.score_ahead': True}); variants compose
    ('dora+score_ahead+rollout_scored' sets both's fields); a clear error otherwise."""
    mode, *variants = name.split("+")
    if mode not in MODES or any(v not in VARIANTS for v in variants) or len(set(variants)) < len(variants):
        raise ValueError(
            f"bench.modes holds {name!r}; expected one of {MODES}, optionally +VARIANT (one or more, "
            f"each once) with VARIANT one of {tuple(VARIANTS)}"
        )
    fields: dict = {}
    for variant in variants:
        for key, value in VARIANTS[variant].items():
            if fields.get(key, value) != value:
                raise ValueError(
                    f"bench.modes holds {name!r}: its variants set {key} to both {fields[key]!r} and {value!r}"
                )
            fields[key] = value
    return mode, fields


def variant_flags(name: str) -> list[str]:
    """The launch_local --config flags of a mode name (its mode and its variant's fields)."""
    mode, fields = split_mode(name)
    return [f"--config.mode={mode}", *(f"--config.{k}={v}" for k, v in fields.items())]


def busy_union(intervals) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted((s, e) for s, e, *_ in intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total = 0.0
    for s, e in a:
        for s2, e2 in b:
            total += max(0.0, min(e, e2) - max(s, s2))
    return total


def take_profile(events) -> dict:
    """What the version window holds each time the trainer takes a batch (means over steps): samples
    still decoding, finished samples whose group is not (a sibling still decodes: the group
    cannot be trained yet), and finished samples of complete groups. Shows whether the trainer
    waits on long-tail stragglers holding their groups back."""
    in_flight: set[str] = set()
    finished: dict[str, set[str]] = {}  # group -> finished samples not yet consumed
    members: dict[str, int] = {}  # group -> samples dispatched
    snapshots, step = [], None
    for event in events:
        kind = event.get("ev")
        if kind == "dispatch" and not event.get("redispatch"):
            in_flight.add(event["traj"])
            members[event["group"]] = members.get(event["group"], 0) + 1
        elif kind == "finish":
            in_flight.discard(event["traj"])
            finished.setdefault(event["traj"].rsplit("/", 1)[0], set()).add(event["traj"])
        elif kind == "consume":
            if event["step"] != step:
                step = event["step"]
                waiting = sum(len(done) for group, done in finished.items() if len(done) < members[group])
                complete = sum(len(done) for group, done in finished.items() if len(done) == members[group])
                snapshots.append((len(in_flight), waiting, complete))
            group = event["traj"].rsplit("/", 1)[0]
            finished.get(group, set()).discard(event["traj"])
    if not snapshots:
        return {}
    mean = np.mean(np.asarray(snapshots, np.float64), axis=0)
    return {
        "decoding": float(mean[0]),
        "finished_in_incomplete_groups": float(mean[1]),
        "finished_in_complete_groups": float(mean[2]),
    }


def straggler_latency(events) -> float:
    """Mean over training batches of the batch's slowest sample: seconds from its first dispatch to
    its finish. A batch cannot be taken before its straggler finishes, and C3 makes the trainer take
    a sample within K steps of its version, so when this exceeds K of the trainer's own (busy) step
    times the window binds and the trainer waits (in the paper K steps outlast the longest
    generation)."""
    dispatched, finished, slowest = {}, {}, {}
    for event in events:
        kind = event.get("ev")
        if kind == "dispatch":
            dispatched.setdefault(event["traj"], event["t"])
        elif kind == "finish":
            finished[event["traj"]] = event["t"]
        elif kind == "consume":
            latency = finished[event["traj"]] - dispatched[event["traj"]]
            slowest[event["step"]] = max(slowest.get(event["step"], 0.0), latency)
    return float(np.mean(list(slowest.values()))) if slowest else 0.0


def mode_row(
    *,
    wall_s: float,
    rows: list[dict],
    rollout_intervals,
    train_intervals,
    train_busy_s: float,
    slot_steps: int,
    idle_slot_steps: int,
    generated_tokens: int,
    trainer_wait_s: float,
    legacy_groups: int,
    report,
    events: list[dict],
    port_wait_s: Mapping[str, float] | None = None,
    trainer_wait_c3_s: float | None = None,
) -> dict:
    """The figures of one mode's run, however its roles ran (threads or processes).
    `trainer_wait_c3_s`: of `trainer_wait_s`, the seconds C3 held a queued batch for older samples
    still decoding (`CoordinatorStats.trainer_wait_c3_s`; None where the run did not say).
    `port_wait_s`: the coordinator's loop seconds waiting on slices' commands, by method
    (`CoordinatorStats.port_wait_s`; None where the run did not say)."""
    rollout = busy_union(rollout_intervals)
    train = busy_union(train_intervals)
    rollout_s = sum(e - s for s, e in rollout)
    rollout_only = rollout_s - overlap(rollout, train)
    steps = len(rows)
    straggler_s = straggler_latency(events)
    return {
        "wall_s": wall_s,
        "steps": steps,
        "train_tokens": sum(r["loss_tokens"] for r in rows),
        "tokens_per_s": sum(r["loss_tokens"] for r in rows) / wall_s,
        "step_time_s": wall_s / steps,
        "rollout_only_share": rollout_only / wall_s,
        "rollout_only_s_per_step": rollout_only / steps,
        "bubble_ratio": idle_slot_steps / slot_steps if slot_steps else 0.0,
        "trainer_wait_s": trainer_wait_s,
        "trainer_wait_c3_s": trainer_wait_c3_s,
        "train_busy_s": train_busy_s,
        "max_staleness": report.max_staleness,
        "audit_ok": report.ok,
        "c1_violations": len(report.c1_violations),
        "migrations_kv": report.migrations_kv,
        "migrations_reprefill": report.migrations_reprefill,
        "legacy_groups": legacy_groups,
        "max_versions_in_flight": report.max_versions_in_flight,
        "generated_tokens": generated_tokens,
        "straggler_s": straggler_s,
        "straggler_train_steps": straggler_s * steps / train_busy_s if train_busy_s else None,
        "at_take": take_profile(events),
        "coordinator_port_wait_s": None if port_wait_s is None else sum(port_wait_s.values()),
        "coordinator_port_wait_by_call_s": None if port_wait_s is None else dict(sorted(port_wait_s.items())),
    }


def schedule(modes, rounds: int, warmup: bool = True) -> list[tuple[str, int | None, str]]:
    """(mode, round, workdir name) of every run: one dora warm-up (round None) that compiles every
    program, then each round runs every mode, interleaved (a noisy spell hits all modes alike)."""
    runs = [("dora", None)] if warmup else []
    runs += [(mode, r) for r in range(rounds) for mode in modes]
    return [(m, r, "warmup" if r is None else m if rounds == 1 else f"{m}_r{r}") for m, r in runs]
