"""End to end over real processes: `python -m dora_jax.launch_local` with 1 trainer and 2 rollout
processes on a very small config; the audit is clean, KV slot states moved between processes, a
rollout process killed mid-run is survived, and nothing is left running afterwards."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from dora_jax.coordinator.audit import audit
from dora_jax.coordinator.ledger import read_ledger

pytestmark = pytest.mark.slow  # every test here starts a multi-process job (launch_local)

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
STEPS, TBS = 6, 16
TINY = [
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
    "--config.rollout.temperature=1.5",
    "--config.task.k_max=20",
    f"--config.coordinator.train_batch_size={TBS}",
    f"--config.coordinator.rollout_batch_size={2 * TBS}",
    f"--config.trainer.micro_batch_size={TBS}",
    "--config.trainer.pad_to=128",
    "--config.log.tensorboard=False",
    # Evaluation rounds add rows to metrics.jsonl; they are checked against the embedded run in
    # tests/test_pod_parity.py. These tests count training rows.
    "--config.eval.every_steps=0",
]


def _command(workdir, *extra) -> dict:
    """subprocess arguments of one launch_local job on TINY (STORAGE_EMULATOR_HOST kept)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    argv = [sys.executable, "-m", "dora_jax.launch_local", *TINY, f"--workdir={workdir}", *extra]
    return dict(args=argv, cwd=ROOT, env=env, text=True)


def _launch(workdir, *extra, timeout=600):
    return subprocess.run(**_command(workdir, *extra), capture_output=True, timeout=timeout)


def _start(workdir, *extra, output=subprocess.PIPE) -> subprocess.Popen:
    """The job started in the background (the test watches it run)."""
    return subprocess.Popen(**_command(workdir, *extra), stdout=output, stderr=output)


def _summary(proc) -> dict:
    out = proc.stdout
    return json.loads(out[out.index("{") :])


def _left_running(workdir) -> list[str]:
    """Processes whose command line names this run's workdir (roles and their reward workers)."""
    alive = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if str(workdir) in cmdline and p.info["pid"] != os.getpid():
            alive.append(cmdline[:120])
    return alive


def test_launch_local_runs_a_clean_multi_process_job(tmp_path):
    # Compiled ahead: a worker still compiling a first-used program when the run ended did not log
    # its clean stop (asserted below) in 2 of 3 runs of this test alone.
    proc = _launch(tmp_path / "run", "--config.rollout.weights_transfer=True", "--config.compile_ahead=True")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = _summary(proc)
    assert summary["trainer_exit"] == 0 and summary["audit_ok"] and summary["processes"] == 4
    events = list(read_ledger(str(tmp_path / "run" / "ledger.jsonl")))
    report = audit(events)
    assert report.ok, report.summary()
    assert report.consumed == STEPS * TBS and report.publishes == STEPS
    # Requests moved between the two processes. Which of them still travel with their KV rows is
    # a race on this trainer-bound CPU config (a queued request admitted before its export); the
    # KV path itself is checked bit-exactly between remote workers in test_port.py.
    assert report.migrations_kv + report.migrations_no_kv > 0, report.summary()
    assert all(e["from"] != e["to"] for e in events if e["ev"] == "migrate")
    # Each says how it moved: KV rows pulled from the source's transfer server (none failed, or the
    # log would say so), re-prefilled where the rule found that cheaper, or still queued.
    assert {e["how"] for e in events if e["ev"] == "migrate"} <= {"kv", "reprefill", "queued"}
    assert report.migrations_kv == sum(e["how"] == "kv" for e in events if e["ev"] == "migrate")
    assert {e["slice"] for e in events if e["ev"] == "finish"} == {0, 1}
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert all(r["generated_tokens"] >= 0 and 0 <= r["bubble_ratio"] <= 1 for r in rows)
    logs = tmp_path / "run" / "logs"  # the roles ended by themselves: trainer -> Finish -> Stop
    assert "the trainer is done: stopping the rollout workers" in (logs / "coordinator.log").read_text()
    assert all("stopped: the run is over" in (logs / f"rollout_{i}.log").read_text() for i in (0, 1))
    assert not any("KV pull of" in (logs / f"rollout_{i}.log").read_text() for i in (0, 1))
    # Versions came device to device from the trainer's transfer server; the tensorstore tier only
    # served what was not on offer yet (at most the first version, read while the trainer offers it).
    tier_reads = [
        line for i in (0, 1) for line in (logs / f"rollout_{i}.log").read_text().splitlines() if "tier" in line
    ]
    assert len(tier_reads) <= 2 and all("version 0 from the tensorstore tier (NotOffered" in t for t in tier_reads)
    loads = [e for e in events if e["ev"] == "load_version"]
    assert len(loads) > len(tier_reads)
    # The coordinator's counters, as its process wrote them at the end: among them, the seconds its
    # loop waited on each kind of slice command.
    stats = json.loads((tmp_path / "run" / "coordinator_stats.json").read_text())
    assert stats["dispatched"] == report.dispatched and stats["switches"] == len(loads)
    assert {"submit", "load_version", "export", "import_"} <= stats["port_wait_s"].keys()
    assert all(seconds > 0 for seconds in stats["port_wait_s"].values())
    assert _left_running(tmp_path / "run") == []


def test_rollout_scored_behaviour_logps_travel_over_grpc(tmp_path):
    """trainer.behaviour_logps = "rollout" across processes: the rollout processes score their
    trajectories and send the log-probs and digest through the codec; the trainer process gets them
    in its batches and recomputes nothing; every consumed row is rollout-scored, with its version's
    digest (the audit checks it)."""
    proc = _launch(tmp_path / "run", "--config.trainer.behaviour_logps=rollout")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = list(read_ledger(str(tmp_path / "run" / "ledger.jsonl")))
    report = audit(events)
    assert report.ok, report.summary()
    assert report.consumed == STEPS * TBS and report.behaviour_rollout == STEPS * TBS
    loaded = {(e["version"], e["digest"]) for e in events if e["ev"] == "load_version"}
    assert {(e["version"], e["behaviour_digest"]) for e in events if e["ev"] == "consume"} <= loaded
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [(r["recomputed_rows"], r["rollout_scored_rows"]) for r in rows] == [(0, TBS)] * STEPS
    assert _left_running(tmp_path / "run") == []


def test_behaviour_logps_scored_ahead_over_grpc(tmp_path):
    """trainer.score_ahead across processes: the trainer's TakeBatch polls bring the finished groups
    of its next batch (`peek`), whose behaviour log-probs it computes while it waits; every stale
    row of a step is scored ahead or recomputed, and the audit (digests included) is clean.
    The trainer must wait for rows to score ahead: while it compiles its first step the rollout
    fills the window (K + 1 batches), so the first steps find their batch ready. One slot on one
    slice and 10 steps leave it several waits (6 steps on two slots found every later batch ready
    in one CI run on fca4515; on one slot, with two CPU-bound processes beside it, 4 of 10 steps
    scored rows ahead)."""
    steps = 10
    proc = _launch(
        tmp_path / "run",
        "--config.trainer.score_ahead=True",
        "--config.rollout.num_slices=1",
        "--config.rollout.slots=1",
        f"--config.num_steps={steps}",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = list(read_ledger(str(tmp_path / "run" / "ledger.jsonl")))
    report = audit(events)
    assert report.ok and report.consumed == steps * TBS, report.summary()
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    consumed = [e for e in events if e["ev"] == "consume"]
    for step, row in enumerate(rows):
        stale = sum(1 for e in consumed if e["step"] == step and e["version"] != step)
        assert row["recomputed_rows"] + row["ahead_rows"] == stale, (row, stale)
    assert sum(r["ahead_rows"] for r in rows) > 0, [(r["recomputed_rows"], r["ahead_rows"]) for r in rows]
    assert _left_running(tmp_path / "run") == []


def test_gradients_computed_ahead_over_grpc(tmp_path):
    """trainer.grad_ahead across processes: the trainer's TakeBatch polls (`peek` + `commit`) bring
    the whole groups the coordinator commits to its next batch; the trainer computes their gradients
    while it waits, every one of them is in the batch it then takes (none dropped), and the audit
    (behaviour digests included) is clean. One slice of 2 slots finishes groups one after another:
    the trainer waits with part of its batch finished; micro-batches of 4 rows, which one group fills
    (a micro-batch is computed ahead once its rows are committed)."""
    proc = _launch(
        tmp_path / "run",
        "--config.trainer.grad_ahead=True",
        "--config.rollout.num_slices=1",
        "--config.trainer.micro_batch_size=4",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = list(read_ledger(str(tmp_path / "run" / "ledger.jsonl")))
    report = audit(events)
    assert report.ok and report.consumed == STEPS * TBS, report.summary()
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert all(r["grad_ahead_dropped"] == 0 and r["grad_ahead_s"] >= 0 for r in rows), rows
    assert sum(r["grad_ahead_rows"] for r in rows) > 0, [r["grad_ahead_rows"] for r in rows]
    assert _left_running(tmp_path / "run") == []


def test_a_killed_rollout_process_is_survived(tmp_path):
    steps = 2 * STEPS  # a run long enough that the kill lands mid-run on a loaded machine
    proc = _launch(tmp_path / "run", f"--config.num_steps={steps}", "--kill_slice=0", "--kill_after_s=0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = _summary(proc)
    assert summary["killed"] and summary["killed"].startswith("rollout_0") and summary["audit_ok"], summary
    events = list(read_ledger(str(tmp_path / "run" / "ledger.jsonl")))
    failed = [e for e in events if e["ev"] == "slice_failed"]
    assert [e["slice"] for e in failed] == [0], failed
    report = audit(events)
    assert report.ok and report.consumed == steps * TBS, report.summary()
    assert failed[0]["requests"] > 0
    assert report.redispatched == failed[0]["requests"]  # every request it held was dispatched again
    after = events.index(failed[0])
    assert {e["slice"] for e in events[after:] if e["ev"] == "dispatch"} == {1}
    assert _left_running(tmp_path / "run") == []


def test_ctrl_c_tears_every_process_down(tmp_path):
    workdir = tmp_path / "run"
    launcher = _start(workdir, "--config.num_steps=1000")
    deadline = time.monotonic() + 300
    ledger = workdir / "ledger.jsonl"
    while not (ledger.exists() and '"ev":"finish"' in ledger.read_text()):
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.5)
    assert len(_left_running(workdir)) >= 4  # coordinator, trainer, 2 rollout workers (+ reward workers)
    launcher.send_signal(signal.SIGINT)
    out, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 1 and "interrupted by signal" in err, err[-2000:]
    assert _left_running(workdir) == []


def test_trainer_cores_pin_every_thread_of_each_role(tmp_path):
    """--trainer_cores=1: once the run is underway (XLA's threads started), every thread of the
    trainer runs on the first core only, every thread of each rollout worker on the others, the
    coordinator anywhere; the run finishes and audits clean."""
    cores = sorted(os.sched_getaffinity(0))
    assert len(cores) >= 2, f"this test splits cores between roles; this machine allows {cores}"
    workdir = tmp_path / "run"
    launcher = _start(workdir, "--trainer_cores=1")
    deadline, metrics = time.monotonic() + 300, workdir / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()):  # a step trained, rollout under way
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.5)
    seen = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        role = next((r for r in ("trainer_worker", "rollout_worker", "serve_coordinator") if r in cmdline), None)
        if role is None or str(workdir) not in cmdline:
            continue
        affinities = set()
        for tid in [t.id for t in p.threads()]:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                affinities.add(frozenset(os.sched_getaffinity(tid)))
        seen.setdefault(role, []).append(affinities)
        assert len(p.threads()) > 2, role  # XLA's and gRPC's threads, not the main one alone
    assert seen["trainer_worker"] == [{frozenset(cores[:1])}], seen
    assert seen["rollout_worker"] == [{frozenset(cores[1:])}] * 2, seen
    assert seen["serve_coordinator"] == [{frozenset(cores)}], seen
    out, err = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, err[-3000:]
    assert json.loads(out[out.index("{") :])["audit_ok"]
    assert f"on cores {cores[:1]}" in (workdir / "logs" / "trainer.log").read_text()


def test_every_role_works_on_a_gs_workdir(gcs_root):
    """The coordinator's ledger, the trainer's metrics and versions, the rollout workers' reads of
    them and the launcher's logs, all on gs:// (a local GCS emulator)."""
    from dora_jax.core import fs

    workdir = fs.join(gcs_root, "run")
    proc = _launch(workdir, "--config.num_steps=3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = _summary(proc)
    assert summary["trainer_exit"] == 0 and summary["audit_ok"] and summary["audit"]["consumed"] == 3 * TBS
    assert fs.listdir(fs.join(workdir, "logs")) == ["coordinator.log", "rollout_0.log", "rollout_1.log", "trainer.log"]
    assert fs.listdir(fs.join(workdir, "versions"))  # what the trainer published and the workers read
    with fs.open(fs.join(workdir, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [0, 1, 2]
    assert _left_running(workdir) == []


def test_a_pod_killed_at_once_resumes_from_its_checkpoint_when_launched_again(tmp_path):
    """A spot preemption: every process SIGKILLed mid-run (the launcher, and with it each role,
    through PDEATHSIG). The same launch on the same workdir resumes: the trainer from its newest
    checkpoint, the coordinator from the state saved in it; the audit over the whole ledger is
    clean, every step trained once, nothing trained twice or lost."""
    workdir = tmp_path / "run"
    launcher = _start(workdir, "--config.checkpoint.every_steps=1", output=subprocess.DEVNULL)
    deadline = time.monotonic() + 400
    checkpoints, metrics = workdir / "checkpoints", workdir / "metrics.jsonl"
    while not ((checkpoints / "2").is_dir() and metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert launcher.poll() is None and time.monotonic() < deadline, "the first launch ended before step 3"
        time.sleep(0.2)
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 30
    while _left_running(workdir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _left_running(workdir) == []
    lost = list(read_ledger(str(workdir / "ledger.jsonl")))
    assert sum(e["ev"] == "publish" for e in lost) < STEPS, "the run finished before it was killed"

    proc = _launch(workdir, "--config.checkpoint.every_steps=1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = _summary(proc)
    assert summary["trainer_exit"] == 0 and summary["audit_ok"], summary
    events = list(read_ledger(str(workdir / "ledger.jsonl")))
    report = audit(events)
    assert report.ok and report.resumes == 1, report.summary()
    assert report.consumed == STEPS * TBS and not report.c1_violations
    resumed = next(e for e in events if e["ev"] == "resume")
    assert resumed["version"] >= 2 and resumed["ledger_offset"] > 0
    assert resumed["in_flight"] > 0  # continued under their own version (the audit's C1), not regenerated
    trainer_log = (workdir / "logs" / "trainer.log").read_text()
    assert f"resumed from the checkpoint of step {resumed['version']}" in trainer_log
    rows = [json.loads(line) for line in open(metrics)]
    assert [r["step"] for r in rows] == list(range(STEPS))  # the lost run's later rows were dropped
    assert _left_running(workdir) == []


@pytest.mark.parametrize("role", ["trainer", "coordinator"])
def test_a_killed_trainer_or_coordinator_is_restarted_in_place_and_the_run_resumes(tmp_path, role):
    """--max_restarts: the dead role alone is started again; the run goes back to the trainer's
    newest checkpoint while the other processes wait (the rollout workers drop their requests and
    rejoin, never restarted); the audit over the whole ledger stays clean."""
    workdir = tmp_path / "run"
    proc = _launch(
        workdir,
        "--config.checkpoint.every_steps=1",
        f"--kill_role={role}",
        "--kill_after_step=2",
        "--max_restarts=1",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = _summary(proc)
    assert summary["killed"].startswith(role) and summary["restarts"] == 1 and summary["audit_ok"], summary
    events = list(read_ledger(str(workdir / "ledger.jsonl")))
    report = audit(events)
    assert report.ok and report.resumes == 1 and report.consumed == STEPS * TBS, report.summary()
    resumed = events.index(next(e for e in events if e["ev"] == "resume"))
    assert events[resumed]["version"] >= 2
    assert {e["slice"] for e in events[resumed:] if e["ev"] == "finish"} == {0, 1}  # both rejoined
    assert [json.loads(line)["step"] for line in open(workdir / "metrics.jsonl")] == list(range(STEPS))
    starts = {name: (workdir / "logs" / f"{name}.log").read_text().count("==== ") for name in _ROLES}
    assert starts == {name: 1 + (name == role) for name in _ROLES}  # only the killed role started twice
    assert _left_running(workdir) == []


_ROLES = ("coordinator", "trainer", "rollout_0", "rollout_1")
