"""`bench modes` on disaggregated cores: each mode is a `launch_local` job whose trainer runs on
its own cores and whose rollout workers run on the others (`--trainer_cores`), as a pod gives
the trainer and the rollout slices their own chips. The coordinator forces the trace's lengths and
scores 0 (`--trace_lengths`); the figures are read back from the job's workdir: the ledger, the
trainer's metrics rows (each step's wall-clock interval) and each rollout worker's timeline
(WORKDIR/timelines). Seconds count from the coordinator's first dispatch to the end of the last
train step, so process start-up and compiles (the roles warm up before the first dispatch) are
left out, as the embedded run leaves them out.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

from dora_jax.bench.mode_row import mode_row, schedule, variant_flags
from dora_jax.coordinator.audit import audit
from dora_jax.coordinator.ledger import read_ledger
from dora_jax.coordinator.stats import STATS_FILE
from dora_jax.coordinator.trace import LengthDistribution
from dora_jax.rollout import timeline
from dora_jax.runtime.metrics import read_metrics


def launch_mode(
    config_flags: list[str], workdir: str, mode: str, num_steps: int, trainer_cores: int, timeout_s: float
) -> None:
    """Runs one mode (or MODE+VARIANT, dora_jax.bench.mode_row.VARIANTS) as a launch_local job
    (exit 0: the trainer finished and the audit is clean)."""
    command = [
        sys.executable,
        "-m",
        "dora_jax.launch_local",
        *config_flags,
        *variant_flags(mode),
        f"--config.num_steps={num_steps}",
        f"--workdir={workdir}",
        "--trace_lengths",
        f"--trainer_cores={trainer_cores}",
        f"--timeout_s={timeout_s}",
    ]
    env = dict(os.environ)
    # Every job compiles the same programs: cache them all (the default skips compiles under 0.5 s,
    # and a train step's shapes that the warm-up job met are then compiled again inside a timed job).
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s + 120, env=env)
    if proc.returncode != 0:
        raise RuntimeError(
            f"bench mode {mode}: `{' '.join(command)}` exited with {proc.returncode}; logs in "
            f"{workdir}/logs\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )


def read_run(workdir: str, num_slots: int) -> dict:
    """The inputs of `mode_row.mode_row` from a finished job's workdir (wall-clock seconds), and its
    timelines in the embedded run's shape (for the plot)."""
    events = list(read_ledger(os.path.join(workdir, "ledger.jsonl")))
    rows = _last_row_per_step(read_metrics(workdir))
    records = timeline.read(workdir)
    if not rows or not records:
        raise RuntimeError(f"{workdir}: no metrics rows or no rollout timelines; was the job cut short?")
    start = min(e["t"] for e in events if e.get("ev") == "dispatch")
    end = rows[-1]["train_interval_t"][1]
    bars = [[b for b in r["bars"] if b[0] < end] for r in records]  # decoding after the last step is not counted
    slot_steps = sum(b[4] * num_slots for slice_bars in bars for b in slice_bars)
    idle = sum(b[4] * num_slots * (1.0 - b[3]) for slice_bars in bars for b in slice_bars)
    train = [(r["train_interval_t"][0], r["train_interval_t"][1], r["step"]) for r in rows]
    legacy = {e["group"] for e in events if e.get("ev") == "dispatch" and e.get("legacy")}
    return {
        "inputs": {
            "wall_s": end - start,
            "rows": rows,
            "rollout_intervals": [(b[0], min(b[1], end)) for slice_bars in bars for b in slice_bars],
            "train_intervals": train,
            # steps, and the work done while waiting for their batches (score_ahead, grad_ahead)
            "train_busy_s": sum(e - s for s, e, _ in train)
            + sum(r.get("score_ahead_s", 0.0) + r.get("grad_ahead_s", 0.0) for r in rows),
            "slot_steps": int(slot_steps),
            "idle_slot_steps": int(round(idle)),
            # one token per busy slot-step: the heartbeat counters in the rows lag the end
            "generated_tokens": int(round(slot_steps - idle)),
            "trainer_wait_s": float(rows[-1].get("trainer_wait_s", 0.0)),
            "trainer_wait_c3_s": float(rows[-1].get("trainer_wait_c3_s", 0.0)),
            "legacy_groups": len(legacy),
            "port_wait_s": _port_waits(workdir),
            "report": audit(events),
            "events": events,
        },
        "timelines": {
            "start": start,
            "slices": [[(b[0], b[1], b[2], b[3]) for b in slice_bars] for slice_bars in bars],
            "trainer": train,
        },
    }


def _port_waits(workdir: str) -> dict[str, float] | None:
    """`CoordinatorStats.port_wait_s` from the coordinator process's stats file (None without one)."""
    path = os.path.join(workdir, STATS_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f).get("port_wait_s")


def run_modes(cfg_dict, out_dir: str, modes, rounds: int, config_flags: list[str]) -> dict:
    """Every mode `rounds` times as launch_local jobs, interleaved within each round, after one
    dora job that fills the persistent compilation cache (unless `bench.warmup` is False).
    Returns what `modes.run_modes` does."""
    trainer_cores = int(cfg_dict.bench.trainer_cores)
    timeout_s = float(cfg_dict.bench.get("timeout_s", 3600.0))
    num_slots = int(cfg_dict.rollout.slots)
    per_round, timelines = [{} for _ in range(rounds)], {}
    for mode, rnd, name in schedule(modes, rounds, warmup=cfg_dict.bench.get("warmup", True)):
        workdir = os.path.join(out_dir, name)
        steps = int(cfg_dict.num_steps)  # the warm-up job too: it meets (and caches) most train-step shapes
        t0 = time.perf_counter()
        launch_mode(config_flags, workdir, mode, steps, trainer_cores, timeout_s)
        if rnd is None:
            continue
        run = read_run(workdir, num_slots)
        row = per_round[rnd][mode] = mode_row(**run["inputs"])
        row["job_wall_s"] = time.perf_counter() - t0  # with process start-up and compiles
        timelines[mode] = run["timelines"]
        print(
            f"round {rnd} {mode:16s} wall {row['wall_s']:7.1f}s  tokens/s {row['tokens_per_s']:8.1f}  "
            f"bubbles {row['bubble_ratio']:.2f}  audit {'ok' if row['audit_ok'] else 'VIOLATIONS'}",
            flush=True,
        )
    lengths = LengthDistribution.of(cfg_dict)
    return {
        "rounds": per_round,
        "timelines": timelines,
        "lengths": dataclasses.asdict(lengths),
    }


def _last_row_per_step(rows: list[dict]) -> list[dict]:
    last = {}
    for row in rows:  # a resumed job rewrites steps: the last row of each step counts
        last[row["step"]] = row
    return [last[s] for s in sorted(last)]
