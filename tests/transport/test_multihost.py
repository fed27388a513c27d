"""Multi-host slices as real multi-controller JAX jobs on CPU (2 processes x 2 fake devices, gloo):
a rollout slice whose host 0 mirrors its calls to host 1 generates exactly what the same slice in
one process does (an exported and re-imported KV slot state included); a trainer step over 2
processes, fixed-shape and length-bucketed, gives the single-process params; hosts that disagree,
or a bad --host_id, fail clearly. One 2-process job (tests/transport/multihost_job.py) runs every
multi-host check while this process computes the one-process references."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from dora_jax.models import init_model, split
from dora_jax.rollout.worker import RolloutWorker
from dora_jax.store import ParamStore, TensorStoreTier
from dora_jax.transport.rollout_agent import fetch_from_store
from tests.transport import multihost_job

pytestmark = pytest.mark.slow  # every test here starts multi-process JAX jobs

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Job:
    """`multihost_job MODE` started as the 2 processes of one JAX job; `wait()` gives their results."""

    def __init__(self, mode: str, workdir):
        port, self._workdir = _free_port(), workdir
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
        # Output to files, not pipes: nobody reads a pipe while the test computes its reference.
        self._logs = [(workdir / f"host{i}.out", workdir / f"host{i}.err") for i in range(multihost_job.N_PROCESSES)]
        self._procs = []
        for i, (out, err) in enumerate(self._logs):
            with open(out, "w") as stdout, open(err, "w") as stderr:
                self._procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "tests.transport.multihost_job", mode, str(i), str(port), str(workdir)],
                        cwd=ROOT,
                        env=env,
                        stdout=stdout,
                        stderr=stderr,
                        text=True,
                    )
                )
        self._results = None

    def wait(self, timeout: float = 300) -> list[subprocess.CompletedProcess]:
        if self._results is None:
            try:
                for proc in self._procs:
                    proc.wait(timeout=timeout)
            finally:
                self.kill()
            self._results = [
                subprocess.CompletedProcess(p.args, p.returncode, out.read_text(), err.read_text())
                for p, (out, err) in zip(self._procs, self._logs)
            ]
        return self._results

    def wait_for(self, *names: str, timeout: float = 300):
        """The paths of the files `names` under the job's DIR once they all exist (its processes
        write them whole), while the job goes on; the job's errors if it ends without them."""
        paths = [self._workdir / name for name in names]
        deadline = time.monotonic() + timeout
        while not all(path.exists() for path in paths):
            missing = [path.name for path in paths if not path.exists()]
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"the job wrote no {missing} in {timeout} s")
            if any(proc.poll() is not None for proc in self._procs):
                self.succeeded()  # raises with a host's stderr if one failed
                raise AssertionError(f"the job ended without writing {missing}")
            time.sleep(0.2)
        return paths

    def kill(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def succeeded(self) -> list[subprocess.CompletedProcess]:
        results = self.wait()
        for i, proc in enumerate(results):
            assert proc.returncode == 0, f"host {i}:\n{proc.stderr[-3000:]}"
        return results


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    """The `slices` job (identity check, rollout slice, trainer steps, over 2 processes), started at
    once: the tests compute their one-process references while it runs."""
    workdir = tmp_path_factory.mktemp("two_hosts")
    store = ParamStore(TensorStoreTier(workdir / "versions"))
    store.publish(0, split(init_model(multihost_job.rollout_model(), seed=3))[1])
    job = _Job("slices", workdir)
    yield job, workdir, store
    job.kill()


def test_a_two_host_rollout_slice_generates_what_one_host_does(two_hosts):
    job, workdir, store = two_hosts
    with multihost_job.fast_compiles():
        worker = RolloutWorker(multihost_job.rollout_engine(jax.devices()[:4]))
        one_host = multihost_job.drive(worker, fetch_from_store(store, worker.engine.param_shardings))
    rollout, follower = job.wait_for("rollout.pkl", "follower.txt")  # the job goes on with the trainer
    assert follower.read_text() == "done"
    two = pickle.loads(rollout.read_bytes())
    got = two["trajectories"]
    assert sorted(got) == sorted(one_host) == [f"t{i}" for i in range(6)]
    assert sum(t.num_migrations for t in got.values()) == 1  # one request left with its KV and came back
    for traj_id, want in one_host.items():
        assert got[traj_id].response_ids == want.response_ids, traj_id
        assert got[traj_id].finish_reason == want.finish_reason
        np.testing.assert_allclose(got[traj_id].logprobs, want.logprobs, rtol=1e-5, atol=1e-5)
    assert two["counters"] == worker.counters


@pytest.fixture(scope="module")
def one_host_trainers(two_hosts):
    """{name: (params leaves, metrics, step traces)} of every TRAINERS step in this process, all
    computed before a test waits for the job's."""
    references = {}
    with multihost_job.fast_compiles():
        for name in multihost_job.TRAINERS:
            trainer, metrics = multihost_job.trainer_step(jax.devices()[:4], name)
            references[name] = (
                jax.tree.leaves(jax.device_get(trainer.params)),
                metrics,
                multihost_job.step_traces(trainer),
            )
    return references


@pytest.mark.parametrize("name", list(multihost_job.TRAINERS))
def test_a_two_host_trainer_step_equals_the_one_host_step(two_hosts, one_host_trainers, name):
    job, workdir, _ = two_hosts
    leaves, metrics, traces = one_host_trainers[name]
    # The step it names ran: the fixed-shape one, or the bucketed one at two bucket lengths (16, 32).
    assert traces == ([0, 2] if name == "bucketed" else [1, 0])
    job.succeeded()
    two = np.load(workdir / f"trainer_{name}.npz")
    assert len(leaves) == len(two.files) - 3
    assert list(two["traces"]) == traces
    np.testing.assert_allclose(two["loss"], metrics.loss, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(two["grad_norm"], metrics.grad_norm, rtol=1e-4, atol=1e-6)
    # As tests/trainer/test_trainer.py bounds sharded == single device: Adam divides by sqrt(v), so
    # where a gradient is near zero, reduction-order noise (here gloo's across processes) moves the
    # update by a few % of lr; a sharding bug moves whole tensors by O(lr): bound the max loosely
    # and the mean tightly.
    lr = 3e-3
    for i, want in enumerate(leaves):
        got = two[f"arr_{i}"]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=0.1 * lr)
        assert np.abs(got - want).mean() < 1e-7


def test_hosts_of_one_slice_that_disagree_fail_naming_the_difference(two_hosts):
    job, workdir, _ = two_hosts
    job.succeeded()
    for i in range(multihost_job.N_PROCESSES):
        # SystemExit with a message: a process that does not catch it exits 1 printing the message.
        raised = (workdir / f"identity{i}.txt").read_text()
        assert raised.startswith("SystemExit: "), f"host {i}: {raised}"
        assert "the hosts of one slice disagree (slice_id: host 0 has 0, host 1 has 1)" in raised, f"host {i}: {raised}"


def test_a_host_id_out_of_range_is_refused_before_any_work(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dora_jax.rollout_worker",
            "--config=configs/smoke.py",
            f"--workdir={tmp_path}",
            "--slice_id=0",
            "--num_hosts=2",
            "--host_id=2",
            "--jax_coordinator=127.0.0.1:1",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "--host_id=2 is out of range for --num_hosts=2; expected 0..1" in proc.stderr


def test_launch_local_refuses_hosts_that_do_not_split_the_mesh(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dora_jax.launch_local",
            "--config=configs/smoke.py",
            f"--workdir={tmp_path}",
            "--hosts_per_slice=2",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and not (tmp_path / "logs").exists()
    assert (
        "--hosts_per_slice=2: mesh.rollout={'tensor': 1} has 1 devices, which do not split over 2 processes"
        in proc.stderr
    ), proc.stderr[-2000:]
    assert "--config.mesh.rollout.tensor=2" in proc.stderr
