"""Kill a training run with SIGKILL at chosen or random moments, resume it, and audit the result.

    python -m dora_jax.chaos --config=configs/smoke.py --workdir=/tmp/chaos --kills=3 --seed=0 \
        [--corrupt_latest] [--config.num_steps=12 --config.checkpoint.every_steps=2 ...]

Each kill runs `python -m dora_jax.train` on the workdir with `DORA_FAULTS=kill=<point>:<n>`
(dora_jax.runtime.faults: a real SIGKILL the n-th time the process reaches `rollout`, `train_step` or
`checkpoint_save`), point and n drawn from the seed; with `--random_time` it is instead killed
from outside after a random delay. Then, optionally after corrupting the newest checkpoint,
the run is resumed to the end and the whole ledger audited. Prints one JSON summary; exits 1
unless the audit is clean, every sample was consumed exactly once and all steps were trained.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from absl import app, flags

from dora_jax import cli
from dora_jax.coordinator.audit import audit
from dora_jax.coordinator.ledger import read_ledger
from dora_jax.core import fs

KILLS = flags.DEFINE_integer("kills", 3, "SIGKILLs before the run may finish")
SEED = flags.DEFINE_integer("seed", 0, "draws the kill points")
RANDOM_TIME = flags.DEFINE_bool("random_time", False, "kill after a random delay instead of at a fault point")
CORRUPT = flags.DEFINE_bool("corrupt_latest", False, "damage the newest checkpoint before the last resume")

POINTS = (("rollout", 15, 120), ("train_step", 2, 6), ("checkpoint_save", 1, 3))  # (point, fewest, most passes)


def draw_plan(kills: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(point, rng.randint(lo, hi)) for point, lo, hi in (rng.choice(POINTS) for _ in range(kills))]


def train_command(config: str, workdir: str, overrides: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "dora_jax.train", f"--config={config}", f"--workdir={workdir}", *overrides]


def run_once(
    command: list[str],
    *,
    fault: str | None = None,
    kill_after_s: float | None = None,
    timeout_s: float = 1800,
    log_path: str | None = None,
) -> int:
    env = dict(os.environ)
    env.pop("DORA_FAULTS", None)
    if fault:
        env["DORA_FAULTS"] = fault
    with open(log_path or os.devnull, "a") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            if kill_after_s is not None:
                try:
                    return process.wait(timeout=kill_after_s)
                except subprocess.TimeoutExpired:
                    process.send_signal(signal.SIGKILL)
            return process.wait(timeout=timeout_s)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


def corrupt_latest_checkpoint(workdir: str) -> str | None:
    """Overwrites the data files of the newest finished checkpoint with garbage; returns its path."""
    root = os.path.join(workdir, "checkpoints")
    steps = sorted(int(d) for d in os.listdir(root) if d.isdigit()) if os.path.isdir(root) else []
    if not steps:
        return None
    path = os.path.join(root, str(steps[-1]), "trainer")
    for dirpath, _, files in os.walk(path):
        for name in files:
            if "/d" in dirpath or name.endswith(".ocdbt"):
                with open(os.path.join(dirpath, name), "wb") as f:
                    f.write(b"not a checkpoint")
    return os.path.join(root, str(steps[-1]))


def chaos(
    config: str,
    workdir: str,
    overrides: Sequence[str],
    plan: Sequence[tuple[str, int]],
    *,
    random_delays: Sequence[float] | None = None,
    corrupt_latest: bool = False,
    timeout_s: float = 1800,
) -> dict:
    """Runs the kills of `plan` (or after `random_delays`), then resumes to the end; returns a summary."""
    command = train_command(config, workdir, overrides)
    log_path = os.path.join(workdir, "chaos.log")
    os.makedirs(workdir, exist_ok=True)
    kills = []
    for i, (point, count) in enumerate(plan):
        start = time.perf_counter()
        if random_delays:
            rc = run_once(command, kill_after_s=random_delays[i], timeout_s=timeout_s, log_path=log_path)
            where = f"after {random_delays[i]:.1f}s"
        else:
            rc = run_once(command, fault=f"kill={point}:{count}", timeout_s=timeout_s, log_path=log_path)
            where = f"{point} #{count}"
        kills.append(
            {
                "where": where,
                "killed": rc == -signal.SIGKILL,
                "returncode": rc,
                "seconds": round(time.perf_counter() - start, 1),
                "metrics_rows": _rows(workdir),
            }
        )
    corrupted = corrupt_latest_checkpoint(workdir) if corrupt_latest else None
    start = time.perf_counter()
    final_rc = run_once(command, timeout_s=timeout_s, log_path=log_path)
    events = list(read_ledger(os.path.join(workdir, "ledger.jsonl")))
    report = audit(events)
    steps = sorted(row["step"] for row in _metric_rows(workdir))
    return {
        "kills": kills,
        "corrupted": corrupted,
        "final_returncode": final_rc,
        "final_seconds": round(time.perf_counter() - start, 1),
        "resumes": [
            {k: e[k] for k in ("ledger_offset", "version", "in_flight", "prefix_tokens")}
            for e in events
            if e["ev"] == "resume"
        ],
        "steps": steps,
        "audit": report.summary(),
        "audit_ok": report.ok,
    }


def _metric_rows(workdir: str) -> list[dict]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


def _rows(workdir: str) -> int:
    return len(_metric_rows(workdir))


def main(argv):
    del argv
    overrides = [a for a in sys.argv[1:] if a.startswith("--config.")]
    if not cli.WORKDIR.value:
        raise app.UsageError("--workdir is required")
    if fs.is_remote(cli.WORKDIR.value):  # it corrupts checkpoint files in place and tails local logs
        raise app.UsageError(f"--workdir={cli.WORKDIR.value}: chaos runs on a local workdir only")
    config_path = next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--config="))
    c = cli.CONFIG.value
    plan = draw_plan(KILLS.value, SEED.value)
    delays = None
    if RANDOM_TIME.value:
        rng = random.Random(SEED.value)
        delays = [rng.uniform(20.0, 90.0) for _ in plan]
    summary = chaos(
        config_path,
        cli.WORKDIR.value,
        overrides,
        plan,
        random_delays=delays,
        corrupt_latest=CORRUPT.value,
        timeout_s=cli.flag_or(cli.TIMEOUT_S, 1800.0),
    )
    print(json.dumps(summary, indent=1))
    complete = summary["steps"] == list(range(c.num_steps))
    exactly = summary["audit"]["consumed"] == c.num_steps * c.coordinator.train_batch_size
    sys.exit(0 if summary["audit_ok"] and complete and exactly and summary["final_returncode"] == 0 else 1)


def run() -> None:
    """The `python -m dora_jax.chaos` entry point."""
    app.run(main)


if __name__ == "__main__":
    run()
