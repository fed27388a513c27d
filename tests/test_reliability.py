"""Reliability end to end: SIGKILL at each kind of moment and resume, a corrupt checkpoint, a
crashed and a hung rollout slice, a failing checkpoint save, and a resume with a changed config.
The audit over the whole ledger must show every sample consumed exactly once and no C1/C3 break."""

import os

import pytest

from dora_jax.cli import chaos
from dora_jax.coordinator.ledger import read_ledger
from dora_jax.runtime import faults, run_config, runner
from dora_jax.runtime.checkpoint import RunCheckpointer, abstract_like
from tests.helpers import CONFIG, tiny_config

STEPS, TBS = 6, 8
OVERRIDES = [
    "--config.init.sft_steps=0",
    "--config.compile_ahead=False",  # a few steps: each process compiles only the programs they use
    "--config.model.hidden_size=64",
    "--config.model.intermediate_size=128",
    "--config.model.head_dim=16",
    "--config.rollout.num_slices=3",
    "--config.rollout.slots=4",
    "--config.rollout.cache_length=128",
    "--config.rollout.max_prefill_length=64",
    "--config.rollout.max_new_tokens=40",
    "--config.task.k_max=20",
    f"--config.coordinator.train_batch_size={TBS}",
    "--config.coordinator.rollout_batch_size=16",
    "--config.trainer.micro_batch_size=8",
    "--config.log.tensorboard=False",
    "--config.eval.every_steps=0",
    f"--config.num_steps={STEPS}",
    "--config.checkpoint.every_steps=2",
]


@pytest.mark.slow
def test_sigkill_during_save_train_step_and_rollout_then_resume_loses_nothing(tmp_path):
    plan = [("checkpoint_save", 2), ("rollout", 5), ("train_step", 1)]
    summary = chaos.chaos(CONFIG, str(tmp_path), OVERRIDES, plan, corrupt_latest=True, timeout_s=900)
    assert [k["returncode"] for k in summary["kills"]] == [-9, -9, -9], summary["kills"]
    assert summary["final_returncode"] == 0, open(tmp_path / "chaos.log").read()[-3000:]
    audit = summary["audit"]
    assert summary["audit_ok"], audit
    assert audit["consumed"] == STEPS * TBS and audit["exactly_once_violations"]["count"] == 0
    assert audit["c1_violations"]["count"] == 0 and audit["c3_violations"]["count"] == 0
    assert summary["steps"] == list(range(STEPS))  # every step trained once, after all the restarts
    assert len(summary["resumes"]) == 3
    assert any(r["ledger_offset"] > 0 for r in summary["resumes"])  # at least one came from a checkpoint
    assert summary["corrupted"] and os.path.isdir(summary["corrupted"] + ".corrupt")  # set aside, previous used


@pytest.fixture
def fault_env(monkeypatch):
    def set_faults(spec):
        monkeypatch.setenv("DORA_FAULTS", spec)
        faults.reset()

    yield set_faults
    faults.reset()


@pytest.mark.slow
def test_crashed_and_hung_slices_and_a_full_disk_do_not_stop_the_run(tmp_path, fault_env):
    # Slices 0 and 1 fail after step 1 while slice 2 hangs after step 2 and holds the coordinator's
    # loop for its 8 s heartbeat: every slice is down at once, and the run waits for the restarts
    # the supervisor promised. Ten steps leave time for the last restart to join before the end
    # (with 6, slice 0's failure came with the last ~1 s of steps, and its rejoin raced the end).
    fault_env("slice_error=1:1,slice_hang=2:2,slice_load_error=0:1,checkpoint_error=2")
    num_steps = 10
    c = tiny_config("dora", steps=num_steps)
    with c.unlocked():
        c.checkpoint.every_steps = 1
        c.rollout.heartbeat_timeout_s = 8.0
        # Compiled before the run: a first-use compile mid-run holds a slice past its 8 s heartbeat
        # on a loaded machine, and the coordinator counts it as hung (a failure this test did not inject).
        c.compile_ahead = True
        c.log.tensorboard = False
    result = runner.run(run_config.parse(c), str(tmp_path), progress=False)
    assert result.steps == num_steps
    assert result.audit.ok, result.audit.summary()
    assert result.audit.consumed == num_steps * TBS
    events = list(read_ledger(str(tmp_path / "ledger.jsonl")))
    failed = {e["slice"]: e for e in events if e["ev"] == "slice_failed"}
    assert set(failed) == {0, 1, 2}
    assert "injected failure" in failed[1]["reason"]
    assert "TimeoutError" in failed[2]["reason"]  # missed heartbeats, or a command it never answered
    assert "StoreError" in failed[0]["reason"] and "load_version failed" in failed[0]["reason"]
    redispatched = [e for e in events if e["ev"] == "dispatch" and e.get("redispatch")]
    assert len(redispatched) == sum(e["requests"] for e in failed.values())
    # Every dropped slice is reported and restarted, whoever found it dead: the crashed one, the
    # hung one once its thread let go of the engine, and the one the coordinator dropped itself.
    joined = [e["slice"] for e in events if e["ev"] == "slice_joined"]
    assert sorted(joined) == [0, 1, 2], joined
    assert sorted(result.coordinator_stats["slice_restarts"]) == [0, 1, 2]
    assert len(result.coordinator_stats["slice_drops"]) == 3
    behaviour = [e for e in events if e["ev"] == "behaviour"]
    assert len(behaviour) == num_steps and all(e["digests"] for e in behaviour)
    assert all("digest" in e for e in events if e["ev"] == "load_version")
    assert len(result.checkpoint_errors) == 1 and "No space left" in result.checkpoint_errors[0]
    steps = RunCheckpointer(str(tmp_path / "checkpoints")).steps()
    assert steps and 2 not in steps  # the failed save left nothing; the others are there

    changed = tiny_config("dora", steps=num_steps + 2)
    with changed.unlocked():
        changed.coordinator.group_size = 2
        changed.coordinator.k_max = 1
        changed.coordinator.rollout_batch_size = 8
    with pytest.raises(ValueError) as err:
        runner.run(run_config.parse(changed), str(tmp_path), progress=False)
    assert "group_size: checkpoint 4, config 2" in str(
        err.value
    ) and "coordinator.k_max: checkpoint 2, config 1" in str(err.value)


def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous(tmp_path):
    import jax.numpy as jnp

    state = {"w": jnp.arange(6.0), "b": jnp.ones((2, 3))}
    ckpt = RunCheckpointer(str(tmp_path), async_save=False)
    ckpt.save(1, state, {}, {"coordinator": {}, "versions": []})
    ckpt.save(2, {k: v + 1 for k, v in state.items()}, {1: state}, {"coordinator": {"n": 2}, "versions": [1]})
    ckpt.wait()
    shardings = {k: v.sharding for k, v in state.items()}
    restored = ckpt.restore_latest(lambda: abstract_like(state, shardings), lambda: abstract_like(state, shardings))
    assert restored.step == 2 and float(restored.trainer_state["w"][0]) == 1.0 and list(restored.versions) == [1]
    assert chaos.corrupt_latest_checkpoint(str(tmp_path.parent / tmp_path.name / "..")) is None  # no checkpoints/ there
    for dirpath, _, files in os.walk(tmp_path / "2" / "trainer"):
        for name in files:
            if "/d" in dirpath:
                (open(os.path.join(dirpath, name), "wb")).write(b"garbage")
    restored = ckpt.restore_latest(lambda: abstract_like(state, shardings), lambda: abstract_like(state, shardings))
    assert restored.step == 1 and float(restored.trainer_state["w"][0]) == 0.0
    assert os.path.isdir(tmp_path / "2.corrupt") and ckpt.steps() == [1]
    ckpt.close()


def test_fault_spec_errors_name_the_item():
    with pytest.raises(ValueError, match="DORA_FAULTS item 'kill=nowhere:1'"):
        faults.parse("kill=nowhere:1")
    assert faults.parse("kill=train_step:3,slice_error=1:2")["slice_error"] == [(1, 2)]
    with pytest.raises(ValueError, match="DORA_FAULTS item 'slice_kill_file=': expected a file path"):
        faults.parse("slice_kill_file=")


def test_a_slice_kill_file_kills_the_worker_at_its_first_step_with_requests(tmp_path):
    """launch_local --kill_slice's fault: nothing happens without the file or with empty slots;
    with both, the process is SIGKILLed and the file is gone (the kill happens once)."""
    import subprocess
    import sys

    kill_file = tmp_path / "kill_rollout_0"
    script = (
        "import os, sys\n"
        "from dora_jax.runtime import faults\n"
        "faults.before_rollout_step(3)\n"  # no file yet
        "open(sys.argv[1], 'w').close()\n"
        "faults.before_rollout_step(0)\n"  # the file, but no request in the slots
        "print('alive', flush=True)\n"
        "faults.before_rollout_step(2)\n"
        "print('survived', flush=True)\n"
    )
    env = {**os.environ, "DORA_FAULTS": f"slice_kill_file={kill_file}"}
    proc = subprocess.run([sys.executable, "-c", script, str(kill_file)], env=env, capture_output=True, text=True)
    assert proc.returncode == -9 and proc.stdout == "alive\n", (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert not kill_file.exists()


@pytest.mark.slow
def test_sigterm_checkpoints_at_a_step_boundary_and_the_rerun_finishes(tmp_path):
    """A preemption notice: the run stops after the step in progress, saves, exits 75; rerun resumes."""
    import json
    import signal
    import subprocess
    import time

    steps = 30
    command = chaos.train_command(
        CONFIG, str(tmp_path), [*OVERRIDES, f"--config.num_steps={steps}", "--config.checkpoint.every_steps=0"]
    )
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert process.poll() is None and time.monotonic() < deadline, "the run ended before the signal"
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=300)
    assert process.returncode == 75, out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["preempted"] and summary["steps"] < steps
    saved = RunCheckpointer(str(tmp_path / "checkpoints")).steps()
    assert saved == [summary["steps"]]  # the only checkpoint: the step boundary where it stopped
    rerun = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-2000:]
    final = json.loads(rerun.stdout.strip().splitlines()[-1])
    assert final["resumed_from"] == summary["steps"] and final["audit_ok"]
    assert len(final["violations"]) and not any(final["violations"].values())
    assert sorted(json.loads(line)["step"] for line in metrics.read_text().splitlines()) == list(range(steps))
