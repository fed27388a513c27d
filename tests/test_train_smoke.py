"""End to end: the embedded runner with real engines, trainer, store and reward pool, every mode.

A shrunken smoke config (tiny model, few steps, no SFT) keeps this to about a minute per mode;
the full smoke run's learning curve is measured by `python -m dora_jax.train` (README).
"""

import json
import os
import subprocess
import sys

import jax
import jax.monitoring
import pytest

from dora_jax.coordinator.audit import audit
from dora_jax.coordinator.ledger import read_ledger
from dora_jax.core import fs
from dora_jax.runtime import faults, run_config, runner
from tests.helpers import CONFIG, tiny_config


@pytest.mark.slow
# dora's end-to-end run of this shape is tests/test_notebook.py's (the same tiny config, audited).
@pytest.mark.parametrize("mode", ["sync", "one_step_off", "partial_rollout"])
def test_embedded_run_keeps_mode_invariants(mode, tmp_path):
    config = run_config.parse(tiny_config(mode))
    result = runner.run(config, str(tmp_path), progress=False)
    assert result.steps == 4
    report = audit(read_ledger(str(tmp_path / "ledger.jsonl")))
    assert report.ok, report.summary()
    assert report.consumed == 4 * 8
    if mode == "sync":
        assert set(report.staleness_histogram) == {0}
    if mode == "one_step_off":
        assert report.max_staleness <= 1
    if mode == "dora":
        assert report.max_staleness <= 2
    events = list(read_ledger(str(tmp_path / "ledger.jsonl")))
    # A request interrupted before its first token (tokens=0) is then sampled by the new version
    # alone under its dispatch label: it too shows as "sampled by" another version.
    interrupted = {e["traj"] for e in events if e["ev"] == "interrupt"}
    mixed = {v.split(":")[0] for v in report.c1_violations}
    if mode == "partial_rollout":
        assert mixed <= interrupted  # only interrupted requests change version
    else:
        assert not interrupted and not mixed
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    for key in (
        "step",
        "reward_mean",
        "tokens_per_s",
        "staleness_max",
        "versions_in_flight",
        "trainer_wait_s",
        "bubble_ratio",
    ):
        assert key in rows[-1]
    assert os.listdir(tmp_path / "tb")


def test_bad_config_is_rejected_naming_the_field():
    c = tiny_config("dora")
    with c.unlocked():
        c.coordinator.train_batch_size = 10
    with pytest.raises(ValueError, match="coordinator.train_batch_size=10 is not a multiple"):
        run_config.parse(c)
    c = tiny_config("dora")
    with c.unlocked():
        c.rollout.num_slices = 9
    config = run_config.parse(c)
    with pytest.raises(ValueError, match="device split asks for"):
        runner.run(config, "/tmp/unused_dora_workdir", progress=False)


def _train_command(workdir: str, *overrides: str) -> list[str]:
    """`python -m dora_jax.train` on the smoke config, shrunk to 2 steps of a tiny model with evaluation."""
    return [
        sys.executable,
        "-m",
        "dora_jax.train",
        f"--config={CONFIG}",
        f"--workdir={workdir}",
        "--config.num_steps=2",
        "--config.compile_ahead=False",  # two steps: compile only the programs they use
        "--config.init.sft_steps=0",
        "--config.model.hidden_size=64",
        "--config.model.intermediate_size=128",
        "--config.model.head_dim=16",
        "--config.rollout.num_slices=2",
        "--config.coordinator.train_batch_size=16",
        "--config.coordinator.rollout_batch_size=32",
        "--config.rollout.max_new_tokens=40",
        "--config.task.k_max=16",
        "--config.eval.every_steps=2",
        "--config.eval.num_prompts=4",
        "--config.eval.samples=1",
        *overrides,
    ]


@pytest.mark.slow
def test_train_cli_writes_config_ledger_metrics_and_audits(tmp_path):
    out = subprocess.run(_train_command(str(tmp_path)), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["audit_ok"] and summary["steps"] == 2
    assert json.load(open(tmp_path / "config.json"))["mode"] == "dora"
    audit_out = subprocess.run([sys.executable, "-m", "dora_jax.audit", str(tmp_path)], capture_output=True, text=True)
    assert audit_out.returncode == 0 and "audit OK" in audit_out.stdout
    # Evaluation at versions 0 and 2 (the last), through the slices, never trained on.
    assert summary["eval"]["steps"] == [0, 2]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    evals = {r["step"]: r for r in rows if "eval/reward_greedy" in r}
    assert sorted(evals) == [0, 2] and all("eval/pass@1" in r and "eval/response_len_mean" in r for r in evals.values())
    samples = [json.loads(line) for line in open(tmp_path / "eval_samples.jsonl")]
    assert len(samples) == 2 * 4 * 2 and sum(s["greedy"] for s in samples) == 2 * 4
    for step, row in evals.items():  # the row's greedy reward is the mean of its greedy samples' rewards
        greedy = [s["reward"] for s in samples if s["step"] == step and s["greedy"]]
        assert row["eval/reward_greedy"] == pytest.approx(sum(greedy) / len(greedy))
    report = audit(read_ledger(str(tmp_path / "ledger.jsonl")))
    assert report.eval_dispatched == report.eval_finished == 2 * 4 * 2 and report.consumed == 2 * 16
    assert "2 rounds, 16 of 16 requests finished" in audit_out.stdout


@pytest.mark.slow
def test_a_gs_workdir_trains_checkpoints_resumes_and_audits_from_the_bucket(gcs_root, tmp_path):
    """Every file of the run on gs:// (a local GCS emulator): ledger, metrics, config.json,
    evaluation samples, TensorBoard events, the reward curve and orbax checkpoints; a second run
    resumes from the bucket's checkpoint and ledger, evaluating again under new round ids, and
    `python -m dora_jax.audit gs://...` audits it."""
    workdir = fs.join(gcs_root, "run")
    cmd = _train_command(workdir, "--config.checkpoint.every_steps=1")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["audit_ok"] and summary["steps"] == 2 and summary["checkpoint_errors"] == []
    assert summary["reward_curve"] == fs.join(workdir, "reward_curve.png") and summary["eval"]["steps"] == [0, 2]
    names = fs.listdir(workdir)
    for name in ("config.json", "ledger.jsonl", "metrics.jsonl", "eval_samples.jsonl", "reward_curve.png"):
        assert name in names
    assert fs.listdir(fs.join(workdir, "checkpoints")) == ["1", "2"] and fs.listdir(fs.join(workdir, "tb"))
    assert not (tmp_path / "gs:").exists()  # nothing went to a local folder named after the URL
    with fs.open(fs.join(workdir, "config.json")) as f:
        assert json.load(f)["mode"] == "dora"

    out = subprocess.run(
        cmd + ["--config.num_steps=3"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["resumed_from"] == 2 and summary["steps"] == 1 and summary["audit_ok"]
    assert summary["eval"]["steps"] == [0, 2, 3]  # the last step's round, e2: not a reused id
    with fs.open(fs.join(workdir, "metrics.jsonl")) as f:
        assert [r["step"] for r in map(json.loads, f) if "reward_mean" in r] == [0, 1, 2]
    audit_out = subprocess.run([sys.executable, "-m", "dora_jax.audit", workdir], capture_output=True, text=True)
    assert audit_out.returncode == 0 and "audit OK" in audit_out.stdout, audit_out.stderr[-2000:]
    report = audit(read_ledger(fs.join(workdir, "ledger.jsonl")))
    assert report.ok and report.resumes == 1 and report.consumed == 3 * 16


def test_a_gs_workdir_without_its_bucket_fails_before_anything_starts(gcs_emulator):
    config = run_config.parse(tiny_config("dora"))
    with pytest.raises(fs.StorageError, match="gs://no-such-bucket/run: bucket gs://no-such-bucket does not exist"):
        runner.run(config, "gs://no-such-bucket/run", progress=False)


def _lowered_while(fn) -> int:
    """Programs jax lowers while `fn()` runs (compiled or read from the persistent cache alike)."""
    count = []

    def listener(event, seconds, **_):
        if event.endswith("jaxpr_to_mlir_module_duration"):
            count.append(1)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return len(count)


@pytest.mark.slow
def test_without_compile_ahead_programs_compile_when_first_used_and_sample_the_same(tmp_path):
    """compile_ahead=False skips the roles' warmups: the run lowers fewer programs, and version 0's
    trajectories (the same params and sampling keys) finish with the same tokens and rewards."""
    runs = {}
    for ahead in (False, True):
        jax.clear_caches()  # each run lowers its programs itself, none reused from the other
        c = tiny_config("sync", steps=1)
        with c.unlocked():
            c.compile_ahead = ahead
            c.rollout.num_slices = 1  # one slice's warmup is enough to tell
        workdir = tmp_path / f"ahead_{ahead}"
        lowered = _lowered_while(lambda c=c, w=workdir: runner.run(run_config.parse(c), str(w), progress=False))
        events = list(read_ledger(str(workdir / "ledger.jsonl")))
        finished = {(e["traj"], e["tokens"], e["reason"]) for e in events if e["ev"] == "finish" and e["version"] == 0}
        scores = sorted(
            json.dumps({k: v for k, v in e.items() if k != "t"}, sort_keys=True)
            for e in events
            if e["ev"] == "score" and e["version"] == 0
        )
        assert audit(events).ok
        runs[ahead] = lowered, finished, scores
    (lazy, lazy_finished, lazy_scores), (eager, eager_finished, eager_scores) = runs[False], runs[True]
    assert lazy < eager, (lazy, eager)
    assert len(lazy_finished) >= 8 and lazy_finished == eager_finished
    assert lazy_scores and lazy_scores == eager_scores


@pytest.mark.slow
def test_embedded_run_with_the_dapo_knobs(tmp_path):
    """Overlong filtering, the soft punishment and failed grades scored, end to end: the rows carry
    their metrics, and a truncated sample is masked exactly when the filter is on."""
    c = tiny_config("sync", steps=2)
    with c.unlocked():
        c.trainer.overlong_filter = True
        # Off: an untrained model's samples are nearly all cut and punished alike, so most groups have
        # no reward variance and dynamic sampling would (rightly) refuse the saturated prompts;
        # tests/test_train_dynamic_sampling.py runs it on prompts of fitting difficulty.
        c.trainer.dynamic_sampling = False
        c.task.overlong_penalty_tokens = 10  # of rollout.max_new_tokens = 40
        c.task.reward_on_error = 0.0
    config = run_config.parse(c)
    result = runner.run(config, str(tmp_path), progress=False)
    assert result.steps == 2 and result.audit.ok, result.audit.summary()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    rows = [r for r in rows if "reward_mean" in r]
    assert len(rows) == 2
    for row in rows:
        assert row["overlong_masked"] == round(row["truncated_fraction"] * 8)  # TBS 8: every truncated one
        assert -1.0 <= row["overlong_penalty_mean"] <= 0.0 and row["reward_errors"] == 0
    # An untrained tiny model rarely stops by itself: samples are cut, masked and punished.
    assert sum(r["overlong_masked"] for r in rows) > 0 and min(r["overlong_penalty_mean"] for r in rows) < 0


def _scored_run(tmp_path, steps: int = 4, source: str = "rollout", mode: str = "dora"):
    """An embedded run with trainer.behaviour_logps = `source`: (result, events, metrics rows)."""
    c = tiny_config(mode, steps=steps)
    with c.unlocked():
        c.trainer.behaviour_logps = source
        c.log.tensorboard = False
    result = runner.run(run_config.parse(c), str(tmp_path), progress=False)
    events = list(read_ledger(str(tmp_path / "ledger.jsonl")))
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    return result, events, rows


@pytest.mark.slow
def test_rollout_scored_behaviour_logps_run_audits_clean(tmp_path):
    """Every consumed row's behaviour log-probs were scored by the slice that generated it (the
    trainer recomputes none), with the params digest its slice loaded for that version."""
    result, events, rows = _scored_run(tmp_path)
    assert result.steps == 4 and result.audit.ok, result.audit.summary()
    consumed = [e for e in events if e["ev"] == "consume"]
    assert len(consumed) == 4 * 8 and all(e["behaviour"] == "rollout" for e in consumed)
    assert (result.audit.behaviour_rollout, result.audit.behaviour_trainer) == (32, 0)
    loaded = {(e["version"], e["digest"]) for e in events if e["ev"] == "load_version"}
    assert {(e["version"], e["behaviour_digest"]) for e in consumed} <= loaded
    assert [r["rollout_scored_rows"] for r in rows] == [8] * 4 and [r["recomputed_rows"] for r in rows] == [0] * 4


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dora", "partial_rollout"])
def test_sampler_behaviour_logps_run_audits_clean(tmp_path, mode):
    """trainer.behaviour_logps = "sampler": every consumed row's behaviour log-probs are its own
    sampling log-probs (partial rollout's included, sampled by several versions), the ledger says
    so row by row, the trainer recomputes none and reports no recompute digests, and the audit
    is clean; the slices score nothing."""
    result, events, rows = _scored_run(tmp_path, source="sampler", mode=mode)
    assert result.steps == 4 and result.audit.ok, result.audit.summary()
    consumed = [e for e in events if e["ev"] == "consume"]
    assert len(consumed) == 4 * 8 and all(e["behaviour"] == "sampler" for e in consumed)
    assert (result.audit.behaviour_sampler, result.audit.behaviour_rollout, result.audit.behaviour_trainer) == (
        32,
        0,
        0,
    )
    assert [e["digests"] for e in events if e["ev"] == "behaviour"] == [{}] * 4
    assert [(r["sampler_rows"], r["recomputed_rows"], r["rollout_scored_rows"]) for r in rows] == [(8, 0, 0)] * 4


@pytest.mark.slow
def test_a_slice_that_cannot_score_leaves_its_rows_to_the_trainer(tmp_path, monkeypatch):
    """Slice 0's scoring fails after step 0 (DORA_FAULTS score_error): what it finishes from then on
    is posted unscored and the trainer recomputes those rows, with that version's params; the rows
    of the other slices still come scored. Nothing is lost and the audit is clean."""
    monkeypatch.setenv("DORA_FAULTS", "score_error=0:0")
    faults.reset()
    try:
        result, events, rows = _scored_run(tmp_path, steps=6)
    finally:
        monkeypatch.delenv("DORA_FAULTS")
        faults.reset()
    assert result.steps == 6 and result.audit.ok, result.audit.summary()
    assert result.audit.consumed == 6 * 8
    consumed = {e["traj"]: e for e in events if e["ev"] == "consume"}
    finished_on = {e["traj"]: e["slice"] for e in events if e["ev"] == "finish"}
    by_trainer = {t for t, e in consumed.items() if e["behaviour"] == "trainer"}
    assert by_trainer and by_trainer != set(consumed)
    assert {finished_on[t] for t in by_trainer} == {0}  # only the slice that could not score
    assert result.audit.behaviour_trainer == len(by_trainer) == sum(r["recomputed_rows"] for r in rows)
    assert sum(r["rollout_scored_rows"] for r in rows) == 6 * 8 - len(by_trainer)


@pytest.mark.slow
def test_behaviour_logps_scored_ahead_while_waiting_audit_clean(tmp_path):
    """trainer.score_ahead: while the trainer waits for a batch it computes the behaviour log-probs
    of the groups already finished for it; every row of a step is then scored ahead, recomputed, or
    the step's own forward gives it (current version), the reported digests are the versions' own
    (the audit checks them), and some rows were scored ahead. One slice of 4 slots finishes the
    groups of 4 one after another: the trainer waits with one group of its batch finished."""
    steps = 8
    c = tiny_config("dora", steps=steps)
    with c.unlocked():
        c.trainer.score_ahead = True
        c.rollout.num_slices = 1
        c.log.tensorboard = False
    result = runner.run(run_config.parse(c), str(tmp_path), progress=False)
    assert result.steps == steps and result.audit.ok, result.audit.summary()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    consumed = [e for e in read_ledger(str(tmp_path / "ledger.jsonl")) if e["ev"] == "consume"]
    assert len(consumed) == steps * 8 and all(e["behaviour"] == "trainer" for e in consumed)
    for step, row in enumerate(rows):
        stale = sum(1 for e in consumed if e["step"] == step and e["version"] != step)
        assert row["recomputed_rows"] + row["ahead_rows"] == stale, (row, stale)
        assert row["score_ahead_s"] >= 0
    assert sum(r["ahead_rows"] for r in rows) > 0, [(r["recomputed_rows"], r["ahead_rows"]) for r in rows]


@pytest.mark.slow
def test_gradients_computed_ahead_while_waiting_audit_clean(tmp_path):
    """trainer.grad_ahead in the embedded run: while the trainer waits for a batch it computes the
    gradients of the groups the coordinator commits to it; each is in the batch it takes (none
    dropped), the audit is clean, and some rows' gradients were computed ahead."""
    steps = 8
    c = tiny_config("dora", steps=steps)
    with c.unlocked():
        c.trainer.grad_ahead = True
        c.trainer.micro_batch_size = 4  # one group fills a micro-batch: it is computed ahead once committed
        c.rollout.num_slices = 1
        c.log.tensorboard = False
    result = runner.run(run_config.parse(c), str(tmp_path), progress=False)
    assert result.steps == steps and result.audit.ok, result.audit.summary()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert all(r["grad_ahead_dropped"] == 0 and r["grad_ahead_s"] >= 0 for r in rows), rows
    assert sum(r["grad_ahead_rows"] for r in rows) > 0, [r["grad_ahead_rows"] for r in rows]
