"""`bench modes` on disaggregated cores, for real: each mode a launch_local job with the trainer on
one core and the rollout workers on the other, the coordinator forcing the trace's lengths."""

import json
import os
import subprocess
import sys

import pytest

from dora_jax.coordinator.ledger import read_ledger
from dora_jax.coordinator.trace import LengthDistribution

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to give each role its own"),
]


def test_bench_modes_runs_each_mode_as_role_processes_on_disjoint_cores(tmp_path):
    out = tmp_path / "bench"
    overrides = [
        "--config.num_steps=3",
        "--config.model.hidden_size=64",
        "--config.model.intermediate_size=128",
        "--config.model.head_dim=16",
        "--config.rollout.slots=4",
        "--config.rollout.cache_length=96",
        "--config.rollout.max_prefill_length=64",
        "--config.rollout.max_new_tokens=60",
        "--config.coordinator.train_batch_size=8",
        "--config.coordinator.rollout_batch_size=16",
        "--config.trainer.pad_to=96",
        "--config.bench.max_len=60",
        "--config.bench.rounds=1",
        "--config.bench.warmup=False",
        "--config.bench.modes=('dora',)",
        "--config.bench.timeout_s=600",
    ]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dora_jax.bench",
            "modes",
            "--config=configs/bench_longtail.py",
            f"--out={out}",
            *overrides,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["roles"].startswith("processes, trainer on 1 core")
    assert set(results["modes"]) == {"dora"}
    for mode, row in results["modes"].items():
        assert row["audit_ok"] and row["steps"] == 3, mode
        assert 0.0 <= row["bubble_ratio"] < 1.0 and row["generated_tokens"] > 0
        assert 0.0 < row["rollout_only_share"] <= 1.0 and row["train_busy_s"] > 0
        # the coordinator process's waits on slice commands (its stats file), summed and by command
        waits = row["coordinator_port_wait_by_call_s"]
        assert {"submit", "load_version"} <= waits.keys() and all(s > 0 for s in waits.values())
        assert row["coordinator_port_wait_s"] == pytest.approx(sum(waits.values()))
        # the part of the trainer's wait C3 held a queued batch (from the trainer's metrics rows)
        assert 0.0 <= row["trainer_wait_c3_s"] <= row["trainer_wait_s"]
    assert "disjoint cores" in results["bound"]["how"]
    # the coordinator forced every response to its drawn length
    lengths = LengthDistribution(median=24.0, sigma=1.1, max_len=60)
    for mode in ("dora",):
        config = json.loads((out / mode / "config.json").read_text())
        seed = int(config["seed"])
        finished = [e for e in read_ledger(str(out / mode / "ledger.jsonl")) if e["ev"] == "finish"]
        assert finished and all(e["reason"] == "forced" for e in finished)
        dispatched = {
            e["traj"]: e["prompt"] for e in read_ledger(str(out / mode / "ledger.jsonl")) if e["ev"] == "dispatch"
        }
        for e in finished:
            sample = int(e["traj"].rsplit("/", 1)[1])
            assert e["tokens"] == lengths.draw(dispatched[e["traj"]], sample, seed), e
        assert {r["slice_id"] for r in map(json.loads, _records(out / mode))} == {0, 1}


def _records(workdir):
    return [(workdir / "timelines" / name).read_text() for name in sorted(os.listdir(workdir / "timelines"))]
