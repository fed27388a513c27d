"""The workdir's writer lease (dora_jax/coordinator/lease.py), on a local directory and on gs:// (the
GCS emulator): a second coordinator is refused by name while the first beats, takes over once the
first is dead (its heartbeat past its timeout, or its process gone on this host), and a holder that
was taken over learns it at its next beat. The embedded runner and serve_coordinator take it first."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from dora_jax.coordinator.lease import LEASE_NAME, LeaseHeld, WriterLease
from dora_jax.core import fs
from dora_jax.transport.auth import new_secret

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
FAST = dict(heartbeat_s=0.1, timeout_s=1.0, settle_s=0.05)


@pytest.fixture(params=["local", "gcs"])
def workdir(request, tmp_path):
    if request.param == "local":
        return str(tmp_path)
    root = request.getfixturevalue("gcs_root")
    fs.makedirs(root)
    return root


def _record(workdir):
    return json.loads(fs.read_bytes(fs.join(workdir, LEASE_NAME)))


def _write(workdir, **fields):
    with fs.open(fs.join(workdir, LEASE_NAME), "w") as f:
        f.write(json.dumps(fields))


def test_a_second_coordinator_is_refused_by_name_while_the_first_beats(workdir):
    first = WriterLease.acquire(workdir, **FAST)
    try:
        record = _record(workdir)
        assert (record["host"], record["pid"], record["id"]) == (socket.gethostname(), os.getpid(), first.id)
        assert set(record) == {"host", "pid", "id", "since", "heartbeat", "heartbeat_s", "timeout_s"}
        assert abs(record["since"] - time.time()) < 5 and (record["heartbeat_s"], record["timeout_s"]) == (0.1, 1.0)
        time.sleep(0.5)  # several beats
        beaten = _record(workdir)
        assert beaten["id"] == first.id and beaten["since"] == record["since"]
        assert beaten["heartbeat"] > record["heartbeat"] + 0.2
        for _ in range(3):  # refused at every try, however long the first lives
            with pytest.raises(LeaseHeld) as refused:
                WriterLease.acquire(workdir, **FAST)
            time.sleep(0.4)
        message = str(refused.value)
        holder = f"coordinator pid {os.getpid()} on host {socket.gethostname()!r} (lease {first.id[:8]})"
        assert f"held by {holder}" in message
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(record["since"]))
        assert f"since {since}, last heartbeat" in message and "another coordinator runs this workdir" in message
        assert _record(workdir)["id"] == first.id  # the refused one wrote nothing
    finally:
        first.release()
    assert not fs.exists(fs.join(workdir, LEASE_NAME))
    with WriterLease.acquire(workdir, **FAST) as again:  # released: free at once
        assert _record(workdir)["id"] == again.id


def test_a_dead_holders_lease_is_taken_over_once_its_heartbeat_is_stale(workdir):
    """A coordinator on another host that stopped beating: refused while its last beat is fresh;
    once it has missed beats the newcomer waits for its timeout, then takes over."""
    beat = time.time()
    dead = dict(host="another-vm", pid=1, id="d" * 32, since=beat - 100, heartbeat=beat, heartbeat_s=0.2, timeout_s=1.5)
    _write(workdir, **dead)
    with pytest.raises(LeaseHeld, match=r"coordinator pid 1 on host 'another-vm' \(lease dddddddd\)"):
        WriterLease.acquire(workdir, **FAST)
    time.sleep(0.6)  # it has missed beats: wait for its verdict rather than refuse
    start = time.monotonic()
    lease = WriterLease.acquire(workdir, **FAST)
    waited = time.monotonic() - start
    try:
        assert _record(workdir)["id"] == lease.id
        assert 0.5 < waited < 3.0, waited  # until 1.5 s after its last beat, not longer
        assert time.time() - beat > 1.5
    finally:
        lease.release()


def test_a_holder_whose_process_died_on_this_host_is_taken_over_at_once(workdir):
    """SIGKILLed (a crash, a kill test): no release, but its pid is gone, so a restart on the same
    host does not wait out its 60 s timeout."""
    script = textwrap.dedent(
        f"""
        import sys, time
        from dora_jax.coordinator.lease import WriterLease
        WriterLease.acquire({workdir!r}, heartbeat_s=0.2, timeout_s=60.0, settle_s=0.05)
        print("held", flush=True)
        time.sleep(600)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(LeaseHeld, match=f"coordinator pid {child.pid} on host"):
            WriterLease.acquire(workdir, **FAST)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    start = time.monotonic()
    with WriterLease.acquire(workdir, **FAST) as lease:
        assert time.monotonic() - start < 5 and _record(workdir)["id"] == lease.id


def test_a_holder_that_was_taken_over_stops_and_is_told(tmp_path):
    told = []
    lease = WriterLease.acquire(str(tmp_path), **FAST, on_lost=told.append)
    now = time.time()
    usurper = dict(host="vm-9", pid=77, id="e" * 32, since=now, heartbeat=now, heartbeat_s=0.1, timeout_s=1.0)
    _write(str(tmp_path), **usurper)  # it stalled past its timeout and another took over
    deadline = time.monotonic() + 5
    while not told and time.monotonic() < deadline:
        time.sleep(0.05)
    assert told == [lease.lost] and "was taken over by coordinator pid 77 on host 'vm-9' (lease eeeeeeee)" in told[0]
    time.sleep(0.3)
    assert _record(str(tmp_path))["id"] == "e" * 32  # it beats no more
    lease.release()
    assert _record(str(tmp_path))["id"] == "e" * 32  # and does not remove the new holder's lease


def test_bad_timing_is_refused():
    with pytest.raises(ValueError, match=r"heartbeat_s=5, timeout_s=5; expected 0 < heartbeat_s < timeout_s"):
        WriterLease("/tmp/x", heartbeat_s=5, timeout_s=5)


def test_the_embedded_runner_refuses_a_workdir_another_coordinator_holds(tmp_path):
    from dora_jax.runtime import run_config, runner
    from tests.helpers import tiny_config

    config = run_config.parse(tiny_config("dora"))
    with WriterLease.acquire(str(tmp_path), **FAST) as held:
        with pytest.raises(LeaseHeld, match=f"lease {held.id[:8]}"):
            runner.run(config, str(tmp_path), progress=False, write_config={"x": 1})
    assert os.listdir(tmp_path) == []  # refused before it read or wrote anything


@pytest.mark.slow
def test_serve_coordinator_refuses_a_workdir_another_coordinator_holds(tmp_path):
    with WriterLease.acquire(str(tmp_path), **FAST) as held:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "dora_jax.serve_coordinator",
                "--config=configs/smoke.py",
                f"--workdir={tmp_path}",
                "--port=0",
            ],
            cwd=ROOT,
            # A run secret, so that the lease, not the missing credential, is what refuses it.
            env=dict(os.environ, JAX_PLATFORMS="cpu", DORA_RUN_SECRET=new_secret().hex()),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 1, proc.stderr[-2000:]
        assert f"error: {tmp_path}/{LEASE_NAME} is held by coordinator pid {os.getpid()}" in proc.stderr
        assert f"(lease {held.id[:8]})" in proc.stderr
        assert sorted(os.listdir(tmp_path)) == [LEASE_NAME]  # no config.json, no ledger
