"""The smoke config run both ways, embedded (`python -m dora_jax.train`, every role in one
process) and as a pod (`python -m dora_jax.launch_local`, each role its own process over gRPC):
the same metric keys in metrics.jsonl, the same kinds of ledger events, evaluation rows at the
same steps in metrics.jsonl and eval_samples.jsonl, and the reward curve, from the same role code."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dora_jax.coordinator.audit import audit
from dora_jax.coordinator.ledger import read_ledger

pytestmark = pytest.mark.slow  # starts the embedded run and a four-process pod

ROOT = os.path.join(os.path.dirname(__file__), "..")
STEPS, EVERY, PROMPTS, SAMPLES = 4, 2, 4, 2
SMALL = [
    "--config=configs/smoke.py",
    f"--config.num_steps={STEPS}",
    "--config.compile_ahead=False",  # a few steps: each process compiles only the programs they use
    "--config.init.sft_steps=0",
    "--config.model.hidden_size=64",
    "--config.model.intermediate_size=128",
    "--config.model.head_dim=16",
    "--config.rollout.num_slices=2",
    "--config.rollout.slots=2",
    "--config.rollout.cache_length=128",
    "--config.rollout.max_prefill_length=64",
    "--config.rollout.max_new_tokens=48",
    "--config.task.k_max=20",
    "--config.coordinator.train_batch_size=16",
    "--config.coordinator.rollout_batch_size=32",
    "--config.trainer.micro_batch_size=16",
    "--config.trainer.pad_to=128",
    "--config.log.tensorboard=False",
    f"--config.eval.every_steps={EVERY}",
    f"--config.eval.num_prompts={PROMPTS}",
    f"--config.eval.samples={SAMPLES}",
]
# Events the schedule decides, not the placement: whether a slice drains for an old version,
# a request migrates, a result comes after its slice failed... One run may write them and the
# other not, by timing alone.
SCHEDULED = {"drain", "migrate", "late_finish", "filtered", "reward_error", "slice_failed", "slice_joined"}


def _run(module: str, workdir) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    proc = subprocess.run(
        [sys.executable, "-m", module, *SMALL, f"--workdir={workdir}"],
        cwd=ROOT,
        env=env,
        text=True,
        capture_output=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _read(workdir) -> tuple[list[dict], list[dict], list[dict]]:
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    samples = [json.loads(line) for line in open(workdir / "eval_samples.jsonl")]
    return rows, list(read_ledger(str(workdir / "ledger.jsonl"))), samples


def _difference(name: str, embedded: set, pod: set) -> str:
    return f"{name}: only embedded {sorted(embedded - pod)}, only pod {sorted(pod - embedded)}"


def test_a_pod_run_writes_what_the_embedded_run_writes(tmp_path):
    _run("dora_jax.train", tmp_path / "embedded")
    _run("dora_jax.launch_local", tmp_path / "pod")
    runs = {name: _read(tmp_path / name) for name in ("embedded", "pod")}
    (rows_e, ledger_e, _), (rows_p, ledger_p, _) = runs["embedded"], runs["pod"]
    keys_e, keys_p = set().union(*rows_e), set().union(*rows_p)
    assert keys_e == keys_p, _difference("metric keys", keys_e, keys_p)
    kinds_e, kinds_p = {e["ev"] for e in ledger_e}, {e["ev"] for e in ledger_p}
    assert kinds_e - SCHEDULED == kinds_p - SCHEDULED, _difference("ledger events", kinds_e, kinds_p)
    evaluated = list(range(0, STEPS + 1, EVERY))
    for name, (rows, ledger, samples) in runs.items():
        report = audit(ledger)
        assert report.ok and report.consumed == STEPS * 16, (name, report.summary())
        assert [r["step"] for r in rows if "reward_mean" in r] == list(range(STEPS)), name
        evals = [r for r in rows if "eval/reward_greedy" in r]
        assert sorted(r["step"] for r in evals) == evaluated, name
        assert all(f"eval/pass@{SAMPLES}" in r and r["eval/wall_s"] > 0 for r in evals), name
        assert sorted({s["step"] for s in samples}) == evaluated, name
        per_step = {step: [s for s in samples if s["step"] == step] for step in evaluated}
        assert all(len(v) == PROMPTS * (1 + SAMPLES) for v in per_step.values()), name
        assert all(sum(s["greedy"] for s in v) == PROMPTS for v in per_step.values()), name
        assert all(s["prompt"] and s["prompt_id"].startswith("eval/") for s in samples), name
        assert os.path.getsize(tmp_path / name / "reward_curve.png") > 0, name
    # The same held-out prompts both ways (built from the same config in each process).
    prompts = {name: {(s["prompt_id"], s["prompt"]) for s in runs[name][2]} for name in runs}
    assert prompts["embedded"] == prompts["pod"] and len(prompts["pod"]) == PROMPTS
