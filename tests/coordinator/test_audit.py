"""The auditor on hand-written ledgers: each violation kind is caught, resume voids lines."""

import json
import subprocess
import sys

from dora_jax.coordinator.audit import audit
from dora_jax.coordinator.ledger import Ledger, read_ledger


def _events(*rows):
    return [{"ev": ev, **fields, "t": 0.0} for ev, fields in rows]


RUN = ("run", dict(mode="dora", k_max=1))


def test_clean_ledger():
    report = audit(_events(RUN, ("dispatch", dict(traj="a", group="g", prompt="p", version=0, slice=0)),
                           ("finish", dict(traj="a", version=0, versions_seen=[0], tokens=3, reason="eos")),
                           ("consume", dict(traj="a", step=1, trainer_version=1))))
    assert report.ok and report.staleness_histogram == {1: 1}


def test_each_violation_is_caught():
    report = audit(_events(
        RUN,
        ("dispatch", dict(traj="a", group="g", prompt="p", version=0, slice=0)),
        ("finish", dict(traj="a", version=0, versions_seen=[0, 1], tokens=3, reason="eos")),  # C1
        ("consume", dict(traj="a", step=2, trainer_version=2)),  # C3 (2 > k_max=1)
        ("consume", dict(traj="a", step=3, trainer_version=2)),  # twice
        ("consume", dict(traj="b", step=3, trainer_version=2)),  # never finished
        ("drop", dict(traj="c", reason="late")),  # C2
    ))
    assert len(report.c1_violations) == 1 and len(report.c3_violations) >= 1
    assert len(report.exactly_once_violations) == 2 and len(report.c2_violations) == 1
    assert not report.ok


def test_partial_rollout_c1_is_reported_but_not_promised():
    events = _events(("run", dict(mode="partial_rollout", k_max=2)),
                     ("dispatch", dict(traj="a", group="g", prompt="p", version=0, slice=0)),
                     ("finish", dict(traj="a", version=0, versions_seen=[0, 1], tokens=3, reason="eos")))
    report = audit(events)
    assert report.c1_violations and report.ok


def test_resume_voids_lost_events(tmp_path):
    rows = [RUN, ("dispatch", dict(traj="a", group="g", prompt="p", version=0, slice=0)),
            ("finish", dict(traj="a", version=0, versions_seen=[0], tokens=3, reason="eos")),
            ("consume", dict(traj="a", step=0, trainer_version=0)),  # lost with the crash
            ("resume", dict(checkpoint_step=0, ledger_offset=3)),
            ("consume", dict(traj="a", step=0, trainer_version=0))]
    report = audit(_events(*rows))
    assert report.ok and report.consumed == 1 and report.voided_events == 1


def test_torn_last_line_and_cli(tmp_path):
    ledger = Ledger(str(tmp_path / "ledger.jsonl"))
    ledger.write("run", mode="sync", k_max=0)
    ledger.write("dispatch", traj="a", group="g", prompt="p", version=0, slice=0)
    ledger.close()
    with open(tmp_path / "ledger.jsonl", "a") as f:
        f.write('{"ev":"finish","traj":"a"')  # torn by a crash
    assert [e["ev"] for e in read_ledger(str(tmp_path / "ledger.jsonl"))] == ["run", "dispatch"]
    out = subprocess.run([sys.executable, "-m", "dora_jax.audit", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0 and "audit OK" in out.stdout
    with open(tmp_path / "ledger.jsonl", "a") as f:
        f.write("\n" + json.dumps({"ev": "consume", "traj": "z", "step": 0, "trainer_version": 0, "t": 0}) + "\n")
    out = subprocess.run([sys.executable, "-m", "dora_jax.audit", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 1 and "audit FAILED" in out.stdout
