"""The role processes fail fast and clearly: a rollout worker whose config differs from the
coordinator's is refused (exit 1, naming the mismatch); one that cannot reach its coordinator
gives up after --connect_timeout_s with the address in the message."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

import dora_jax
from dora_jax.transport import auth
from dora_jax.transport.service import CoordinatorService, Identity, make_server

pytestmark = pytest.mark.slow  # every test here starts a rollout_worker process

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
CONFIG = [
    "--config=configs/smoke.py",
    "--config.init.sft_steps=0",
    "--config.rollout.num_slices=2",
    "--config.rollout.slots=4",
]


SECRET = bytes(range(32))


def _rollout_worker(tmp_path, address, *extra, timeout=300):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    env[auth.TOKEN_ENV] = auth.role_token(SECRET, auth.rollout(1))  # what launch_local hands slice 1
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "dora_jax.rollout_worker",
            *CONFIG,
            f"--workdir={tmp_path}",
            f"--coordinator={address}",
            "--slice_id=1",
            *extra,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_worker_with_another_config_is_refused(tmp_path):
    service = CoordinatorService(Identity("f" * 64, dora_jax.__version__, 2, 4), log=lambda m: None)
    server, port = make_server(service, 0, host="127.0.0.1", auth=auth.Authenticator(SECRET, 2))
    try:
        proc = _rollout_worker(tmp_path, f"127.0.0.1:{port}")
    finally:
        server.stop(0)
    assert proc.returncode == 1, proc.stderr[-2000:]
    # The worker's own hash is named, never the coordinator's (a refusal reveals nothing of the run).
    assert "refused Register: config hash" in proc.stderr and "ffffffffffff" not in proc.stderr
    assert "same --config file and the same --config.* overrides" in proc.stderr
    assert service.ports == {}


def test_a_worker_without_a_role_token_exits_naming_the_variables(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in auth.CREDENTIAL_ENV}
    proc = subprocess.run(
        [sys.executable, "-m", "dora_jax.rollout_worker", *CONFIG, f"--workdir={tmp_path}", "--coordinator=127.0.0.1:1"]
        + ["--slice_id=1"],
        cwd=ROOT,
        env=dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    assert "cannot authenticate to the coordinator: no role token: set DORA_ROLE_TOKEN_FILE" in proc.stderr


def test_an_unreachable_coordinator_ends_the_worker_after_the_deadline(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    start = time.monotonic()
    proc = _rollout_worker(tmp_path, address, "--connect_timeout_s=3", "--call_timeout_s=0.5")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"error: coordinator at {address} unreachable for" in proc.stderr
    assert "(limit 3s) during Register" in proc.stderr
    assert time.monotonic() - start < 120


def test_trainer_cores_split_the_launchers_cores_or_name_the_flag():
    from dora_jax.runtime.cores import role_cores

    assert role_cores(0, [0, 1]) == {}
    assert role_cores(1, [2, 5, 7]) == {"trainer": [2], "rollout": [5, 7]}
    assert role_cores(2, [2, 5, 7]) == {"trainer": [2, 5], "rollout": [7]}
    for bad in (2, 3, -1):
        with pytest.raises(ValueError, match=rf"--trainer_cores={bad}; this launcher may use 2 cores \[0, 1\]"):
            role_cores(bad, [0, 1])


class _Service:
    """What the coordinator's serving loop reads of CoordinatorService: the generation and the end."""

    def __init__(self, generation: int):
        self.generation = generation
        self.finished = threading.Event()


class _Coordinator:
    """process() raises as a coordinator does when every slice's port has failed; with `rewind`, the
    ports failed because a restarted trainer bumped the service's generation meanwhile."""

    def __init__(self, service: _Service, rewind: bool):
        self.service, self.rewind, self.calls = service, rewind, 0

    def process(self, timeout: float) -> None:
        self.calls += 1
        if self.calls < 3:
            return
        if self.rewind:
            self.service.generation += 1
        raise RuntimeError("every rollout slice has failed (last: slice 0: load_version failed: PortError)")


def test_an_error_of_a_rewound_generation_ends_the_generation_not_the_run():
    """A restarted trainer's rewind fails every rollout port, possibly while the coordinator is calling
    one: what that raises belongs to the rewound generation, so the serving loop goes on to the next
    (test_launch_local's trainer restart stopped the run on it in CI). An error while the generation is
    live still stops the run, and the trainer's end ends it."""
    from dora_jax.runtime.placements import coordinator_process

    service = _Service(generation=3)
    coord = _Coordinator(service, rewind=True)
    assert coordinator_process._serve_generation(coord, service, 3, threading.Event()) is False
    assert (coord.calls, service.generation) == (3, 4)
    with pytest.raises(RuntimeError, match="every rollout slice has failed"):
        coordinator_process._serve_generation(_Coordinator(service, rewind=False), service, 4, threading.Event())
    service.finished.set()
    assert coordinator_process._serve_generation(_Coordinator(service, rewind=False), service, 4, threading.Event())
