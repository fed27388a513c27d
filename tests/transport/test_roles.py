"""The role processes fail fast and clearly: a rollout worker whose config differs from the
coordinator's is refused (exit 1, naming the mismatch); one that cannot reach its coordinator
gives up after --connect_timeout_s with the address in the message."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

import dora_jax
from dora_jax.transport.service import CoordinatorService, Identity, make_server

pytestmark = pytest.mark.slow  # every test here starts a rollout_worker process

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
CONFIG = [
    "--config=configs/smoke.py",
    "--config.init.sft_steps=0",
    "--config.rollout.num_slices=2",
    "--config.rollout.slots=4",
]


def _rollout_worker(tmp_path, address, *extra, timeout=300):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
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
    server, port = make_server(service, 0, host="127.0.0.1")
    try:
        proc = _rollout_worker(tmp_path, f"127.0.0.1:{port}")
    finally:
        server.stop(0)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "refused Register: config hash" in proc.stderr and "ffffffffffff" in proc.stderr
    assert "same --config file and the same --config.* overrides" in proc.stderr
    assert service.ports == {}


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
