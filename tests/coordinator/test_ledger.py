"""The ledger's buffering: lines reach the file by the interval, and always before a snapshot; on
gs:// (a local GCS emulator) too, where a resumed run is audited from the bucket."""

import json
import subprocess
import sys

from dora_jax.cli.audit import audit_workdir
from dora_jax.coordinator.audit import audit
from dora_jax.coordinator.ledger import Ledger, read_ledger
from dora_jax.core import fs
from tests.coordinator.fakes import make_coordinator


def _lines(path):
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f)


def test_lines_are_buffered_until_the_interval_or_a_flush(tmp_path):
    path = str(tmp_path / "ledger.jsonl")
    ledger = Ledger(path, flush_interval_s=3600)
    for i in range(5):
        ledger.write("dispatch", traj=f"g0/{i}")
    assert ledger.lines_written == 5 and _lines(path) == 0
    ledger.flush()
    assert _lines(path) == 5
    every_line = Ledger(str(tmp_path / "eager.jsonl"), flush_interval_s=0)
    every_line.write("publish", version=1)
    assert _lines(tmp_path / "eager.jsonl") == 1
    ledger.write("publish", version=1)
    ledger.close()
    assert [e["ev"] for e in read_ledger(path)] == ["dispatch"] * 5 + ["publish"]
    assert Ledger(path).lines_written == 6  # a reopened ledger counts the file's lines


def test_a_snapshot_offset_never_counts_a_line_that_is_not_in_the_file(tmp_path):
    path = str(tmp_path / "ledger.jsonl")
    coord, workers = make_coordinator("dora", Ledger(path, flush_interval_s=3600))
    coord.start()
    for _ in range(30):
        for w in workers.values():
            w.tick()
        coord.process()
    state = json.loads(json.dumps(coord.snapshot()))
    assert state["ledger_offset"] > 0 and _lines(path) == state["ledger_offset"]


def _run(coord, workers, version, steps):
    """Ticks every worker and trains until `steps` versions exist; returns the version."""
    while version < steps:
        for w in workers.values():
            w.tick()
        coord.process()
        if coord.try_take_batch(version) is not None:
            version += 1
            coord.post_published(version)
            coord.process()
    return version


def test_on_gcs_a_snapshot_offset_holds_and_a_resumed_run_audits_clean_from_the_bucket(gcs_root):
    path = fs.join(gcs_root, "ledger.jsonl")
    ledger = Ledger(path, flush_interval_s=0.05)
    coord, workers = make_coordinator("dora", ledger)
    coord.start()
    version = _run(coord, workers, 0, 2)
    state = json.loads(json.dumps(coord.snapshot()))
    assert state["ledger_offset"] > 0 and fs.read_bytes(path).count(b"\n") == state["ledger_offset"]  # stored
    _run(coord, workers, version, 4)  # the work a crash will lose
    ledger.flush()  # ... after it reached the bucket: the resume must void it
    # The process dies here: its ledger never closed (chunk objects, no final object).

    resumed = Ledger(path)
    assert resumed.lines_written == fs.read_bytes(path).count(b"\n") > state["ledger_offset"]
    coord2, workers2 = make_coordinator("dora", resumed, initial_version=version)
    coord2.restore(state)
    coord2.start()
    _run(coord2, workers2, version, 6)
    resumed.close()
    report = audit_workdir(gcs_root)
    assert report.ok and report.resumes == 1 and report.voided_events > 0 and report.consumed == 6 * 8, report.summary()
    assert report.summary() == audit(read_ledger(path)).summary()
    out = subprocess.run([sys.executable, "-m", "dora_jax.audit", gcs_root], capture_output=True, text=True)
    assert out.returncode == 0 and "audit OK" in out.stdout, out.stderr[-2000:]
