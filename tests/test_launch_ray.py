"""The Ray placement end to end on a real local Ray cluster (`ray.cluster_utils.Cluster`, kept by
tests/ray_cluster_keeper.py in a process of its own) whose nodes are fake TPU hosts
(`launch_ray.fake_tpu_node_args`: the resources and labels Ray gives a TPU VM):
`python -m dora_jax.launch_ray` places the roles on TPU slice placement groups
(`ray.util.tpu.slice_placement_group`), a multi-host slice one actor per host forming one JAX job;
a rollout actor and the trainer actor killed mid-run are restarted by Ray and the run finishes
with a clean audit; a job stopped (SIGTERM, what `ray job stop` sends) and submitted again on its
workdir resumes from its checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dora_jax.cli.launch_ray import namespace
from dora_jax.coordinator.audit import audit
from dora_jax.coordinator.ledger import read_ledger
from tests.transport.test_launch_local import TBS, TINY

pytestmark = pytest.mark.slow  # a Ray cluster and multi-process jobs

ROOT = os.path.join(os.path.dirname(__file__), "..")
# The cluster's fake TPU slices: three one-host v4-8 (4 chips) and one two-host v4-16.
SLICES = {"a": ("v4-8", 1), "b": ("v4-8", 1), "c": ("v4-8", 1), "d": ("v4-16", 2)}


class _Cluster:
    """The cluster, kept by tests/ray_cluster_keeper.py in a process of its own."""

    def __init__(self):
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.ray_cluster_keeper", json.dumps(SLICES)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.address = self._answer()["address"]

    def _answer(self) -> dict:
        while True:  # Ray may print lines of its own
            line = self._proc.stdout.readline()
            assert line, f"the Ray cluster keeper ended (exit {self._proc.wait()})"
            if line.startswith("{"):
                return json.loads(line)

    def kill(self, workdir, actor: str) -> None:
        """`ray.kill` of the run's named actor; Ray restarts it."""
        self._proc.stdin.write(f"kill {namespace(str(workdir))} {actor}\n")
        self._proc.stdin.flush()
        assert self._answer() == {"killed": actor}

    def shutdown(self) -> None:
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout=120)
        finally:
            if self._proc.poll() is None:
                self._proc.kill()


@pytest.fixture(scope="module")
def cluster():
    c = _Cluster()
    yield c
    c.shutdown()


def _command(cluster, workdir, *extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "RAY_ADDRESS")}
    argv = [
        sys.executable,
        "-m",
        "dora_jax.launch_ray",
        *TINY,
        f"--workdir={workdir}",
        f"--address={cluster.address}",
        "--trainer_type=v4-8",
        "--rollout_type=v4-8",
        *extra,
    ]
    return dict(args=argv, cwd=ROOT, env=env, text=True)


def _summary(out: str) -> dict:
    return json.loads(out[out.index('{\n "workdir"') :])


def _wait_for(predicate, what: str, proc: subprocess.Popen, timeout_s: float = 400.0) -> float:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"the job ended before {what}:\n{out[-4000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return time.monotonic()


def _events(workdir) -> list[dict]:
    path = workdir / "ledger.jsonl"
    return list(read_ledger(str(path))) if path.exists() else []


def test_a_two_host_rollout_slice_is_one_actor_per_fake_host(cluster, tmp_path):
    workdir = tmp_path / "run"
    proc = subprocess.run(
        **_command(
            cluster,
            workdir,
            "--config.num_steps=2",
            "--config.rollout.num_slices=1",
            "--config.mesh.rollout.tensor=2",
            "--rollout_type=v4-16",
        ),
        capture_output=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = _summary(proc.stdout)
    assert summary["audit_ok"] and summary["roles"]["trainer"] == 0, summary
    where = summary["placement"]
    assert set(where) == {"coordinator", "trainer", "rollout_0", "rollout_0_h1"}
    # The slice's two hosts: one actor on each fake host of the same two-host slice.
    assert (where["rollout_0"]["slice"], where["rollout_0"]["host"]) == ("slice-d", "0")
    assert (where["rollout_0_h1"]["slice"], where["rollout_0_h1"]["host"]) == ("slice-d", "1")
    assert where["rollout_0"]["node"] != where["rollout_0_h1"]["node"]
    assert where["trainer"]["slice"] in ("slice-a", "slice-b", "slice-c")
    # One JAX job over the slice's two processes: host 0 served the coordinator, mirroring to host 1.
    events = _events(workdir)
    assert {e["slice"] for e in events if e["ev"] == "finish"} == {0}
    assert audit(events).consumed == 2 * TBS


def test_killed_rollout_and_trainer_actors_are_restarted_and_the_run_finishes(cluster, tmp_path):
    """A rollout actor killed once its slice has finished work, then the trainer actor once step 3
    is checkpointed: Ray restarts each (max_restarts), the slice rejoins, the trainer goes back
    to its checkpoint, and the whole ledger audits clean with every sample trained once."""
    steps = 10
    workdir = tmp_path / "run"
    proc = subprocess.Popen(
        **_command(cluster, workdir, f"--config.num_steps={steps}", "--config.checkpoint.every_steps=1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_for(lambda: any(e["ev"] == "finish" and e.get("slice") == 1 for e in _events(workdir)), "work", proc)
        killed_at = time.time()
        cluster.kill(workdir, "rollout_1")
        _wait_for(lambda: (workdir / "checkpoints" / "3").is_dir(), "the checkpoint of step 3", proc)
        cluster.kill(workdir, "trainer")
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    summary = _summary(out)
    assert summary["audit_ok"] and summary["roles"]["trainer"] == 0, summary
    events = _events(workdir)
    report = audit(events)
    assert report.ok and report.resumes == 1 and report.consumed == steps * TBS, report.summary()
    failed = next(i for i, e in enumerate(events) if e["ev"] == "slice_failed" and e["slice"] == 1)
    # Back in the run: the restarted slice loads a version and finishes work again.
    loaded = next(e for e in events[failed:] if e["ev"] == "load_version" and e["slice"] == 1)
    print(f"rollout actor killed -> its slice loaded a version again: {loaded['t'] - killed_at:.1f} s")
    assert any(e["ev"] == "finish" and e.get("slice") == 1 for e in events[events.index(loaded) :])
    resumed = events.index(next(e for e in events if e["ev"] == "resume"))
    assert events[resumed]["version"] >= 3
    assert [json.loads(line)["step"] for line in open(workdir / "metrics.jsonl")] == list(range(steps))


def test_a_stopped_job_resumes_when_submitted_again(cluster, tmp_path):
    """SIGTERM to the driver (what `ray job stop` sends first): every role is stopped, the
    trainer first with a checkpoint of its last step; the same command on the same workdir
    resumes from the newest checkpoint and the audit over the whole ledger is clean, every step
    trained once."""
    steps = 6
    workdir = tmp_path / "run"
    extra = (f"--config.num_steps={steps}", "--config.checkpoint.every_steps=1")
    proc = subprocess.Popen(**_command(cluster, workdir, *extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: (workdir / "checkpoints" / "2").is_dir(), "the checkpoint of step 2", proc)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    first = _summary(out)
    # The trainer was stopped first: it finished its step, saved a checkpoint of it and exited 75.
    assert first["roles"]["trainer"] == 75, first["roles"]
    published = [e["version"] for e in _events(workdir) if e["ev"] == "publish"]
    assert max(published) < steps
    assert (workdir / "checkpoints" / str(max(published))).is_dir(), sorted(os.listdir(workdir / "checkpoints"))

    again = subprocess.run(**_command(cluster, workdir, *extra), capture_output=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert _summary(again.stdout)["audit_ok"]
    report = audit(_events(workdir))
    assert report.ok and report.resumes == 1 and report.consumed == steps * TBS, report.summary()
    assert [json.loads(line)["step"] for line in open(workdir / "metrics.jsonl")] == list(range(steps))
