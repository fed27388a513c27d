"""The auditor on hand-written ledgers: each violation kind is caught, resume voids lines."""

import json
import subprocess
import sys

import pytest

from dora_jax.coordinator.audit import audit
from dora_jax.coordinator.ledger import Ledger, read_ledger


def _events(*rows):
    return [{"ev": ev, **fields, "t": 0.0} for ev, fields in rows]


RUN = ("run", dict(mode="dora", k_max=1))
LOAD0 = ("load_version", dict(slice=0, version=0, digest="d0"))


def test_clean_ledger():
    report = audit(
        _events(
            RUN,
            LOAD0,
            ("dispatch", dict(traj="a", group="g", prompt="p", version=0, slice=0)),
            ("finish", dict(traj="a", version=0, versions_seen=[0], tokens=3, reason="eos")),
            ("behaviour", dict(step=1, digests={"0": "d0"})),
            ("consume", dict(traj="a", group="g", version=0, step=1, trainer_version=1)),
        )
    )
    assert report.ok and report.staleness_histogram == {1: 1}, report.summary()


def test_each_violation_is_caught():
    report = audit(
        _events(
            RUN,
            LOAD0,
            ("dispatch", dict(traj="a", group="g", prompt="p", version=0, slice=0)),
            ("finish", dict(traj="a", version=0, versions_seen=[0, 1], tokens=3, reason="eos")),  # C1
            ("consume", dict(traj="a", step=2, trainer_version=2)),  # C3 (2 > k_max=1)
            ("consume", dict(traj="a", step=3, trainer_version=2)),  # twice
            ("consume", dict(traj="b", step=3, trainer_version=2)),  # never finished
            ("drop", dict(traj="c", reason="late")),  # C2
        )
    )
    assert len(report.c1_violations) == 1 and len(report.c3_violations) >= 1
    assert len(report.exactly_once_violations) == 2 and len(report.c2_violations) == 1
    assert not report.ok


def test_partial_rollout_c1_is_reported_but_not_promised():
    events = _events(
        ("run", dict(mode="partial_rollout", k_max=2)),
        ("dispatch", dict(traj="a", group="g", prompt="p", version=0, slice=0)),
        ("finish", dict(traj="a", version=0, versions_seen=[0, 1], tokens=3, reason="eos")),
    )
    report = audit(events)
    assert report.c1_violations and report.ok


def test_resume_voids_lost_events(tmp_path):
    rows = [
        RUN,
        LOAD0,
        ("dispatch", dict(traj="a", group="g", prompt="p", version=0, slice=0)),
        ("finish", dict(traj="a", version=0, versions_seen=[0], tokens=3, reason="eos")),
        ("consume", dict(traj="a", step=0, trainer_version=0)),  # lost with the crash
        ("resume", dict(checkpoint_step=0, ledger_offset=4)),
        ("consume", dict(traj="a", step=0, trainer_version=0)),
    ]
    report = audit(_events(*rows))
    assert report.ok and report.consumed == 1 and report.voided_events == 1


@pytest.mark.slow
def test_torn_last_line_and_cli(tmp_path):
    ledger = Ledger(str(tmp_path / "ledger.jsonl"))
    ledger.write("run", mode="sync", k_max=0)
    ledger.write("load_version", slice=0, version=0)
    ledger.write("dispatch", traj="a", group="g", prompt="p", version=0, slice=0)
    ledger.close()
    with open(tmp_path / "ledger.jsonl", "a") as f:
        f.write('{"ev":"finish","traj":"a"')  # torn by a crash
    assert [e["ev"] for e in read_ledger(str(tmp_path / "ledger.jsonl"))] == ["run", "load_version", "dispatch"]
    out = subprocess.run([sys.executable, "-m", "dora_jax.audit", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0 and "audit OK" in out.stdout
    with open(tmp_path / "ledger.jsonl", "a") as f:
        f.write("\n" + json.dumps({"ev": "consume", "traj": "z", "step": 0, "trainer_version": 0, "t": 0}) + "\n")
    out = subprocess.run([sys.executable, "-m", "dora_jax.audit", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 1 and "audit FAILED" in out.stdout
    missing = tmp_path / "nowhere"
    out = subprocess.run([sys.executable, "-m", "dora_jax.audit", str(missing)], capture_output=True, text=True)
    assert out.returncode == 2 and f"{missing}: no ledger" in out.stderr and "Traceback" not in out.stderr


# ---- one hand-made bad ledger per check the auditor gained; each must fire, and only it.
def _one(rows, kind):
    report = audit(_events(RUN, *rows))
    counts = {k: v for k, v in report.violations().items() if v}
    assert counts == {kind: 1}, report.summary()
    return report


def _run(traj, version, slice_id=0, group="g", trainer_version=None):
    rows = [
        ("dispatch", dict(traj=traj, group=group, prompt="p", version=version, slice=slice_id)),
        ("finish", dict(traj=traj, version=version, versions_seen=[version], tokens=3, reason="eos")),
    ]
    if trainer_version is not None:
        rows.append(
            (
                "consume",
                dict(traj=traj, group=group, version=version, step=trainer_version, trainer_version=trainer_version),
            )
        )
    return rows


def test_a_sample_stranded_past_the_window_is_a_c2_loss():
    # b (v0) was dispatched and finished, then forgotten: after the take at trainer version 2,
    # nothing of v0 can be trained within K = 1 any more.
    rows = [
        LOAD0,
        *_run("a", 0, trainer_version=1),
        ("load_version", dict(slice=0, version=1)),
        *_run("c", 1, group="h", trainer_version=2),
        ("dispatch", dict(traj="b", group="g2", prompt="p", version=0, slice=1)),
    ]
    report = audit(_events(RUN, ("load_version", dict(slice=1, version=0)), *rows))
    assert report.violations()["C2"] == 1 and report.stranded == 1 and "b (v0)" in report.c2_violations[0]
    # the same sample while the window can still take it (the last take at trainer version 0) is
    # in flight, not lost
    fine = audit(
        _events(
            RUN,
            ("load_version", dict(slice=1, version=0)),
            LOAD0,
            *_run("a", 0, trainer_version=0),
            ("dispatch", dict(traj="b", group="g2", prompt="p", version=0, slice=1)),
        )
    )
    assert fine.ok and fine.in_flight_at_end == 1, fine.summary()


def test_a_dispatch_to_a_slice_serving_another_version_breaks_c1():
    _one([LOAD0, ("load_version", dict(slice=1, version=1)), *_run("a", 0, slice_id=1)], "C1")


def test_a_dispatch_to_a_failed_slice_breaks_c1_until_it_loads_again():
    _one([LOAD0, ("slice_failed", dict(slice=0, reason="x", requests=0)), *_run("a", 0)], "C1")
    report = audit(_events(RUN, LOAD0, ("slice_joined", dict(slice=0)), LOAD0, *_run("a", 0)))
    assert report.ok


def test_a_migration_to_a_slice_with_nothing_loaded_breaks_c1():
    _one([LOAD0, *_run("a", 0)[:1], ("migrate", {"traj": "a", "from": 0, "to": 3, "version": 0, "kv": True})], "C1")


def test_a_group_consumed_with_mixed_versions_breaks_c3():
    # g/1 was re-tagged to v1 although g/0 was sampled by v0: a group of two versions.
    report = _one(
        [
            LOAD0,
            ("load_version", dict(slice=1, version=1)),
            *_run("g/0", 0, trainer_version=1),
            *_run("g/1", 1, slice_id=1, trainer_version=1),
        ],
        "C3",
    )
    assert "mixes v0 and v1" in report.c3_violations[0]


def test_a_consume_whose_stated_version_is_not_the_dispatch_version_breaks_c3():
    rows = [LOAD0, *_run("a", 0), ("consume", dict(traj="a", group="g", version=1, step=1, trainer_version=1))]
    assert "consumed as v1 but dispatched as v0" in _one(rows, "C3").c3_violations[0]


def test_the_trainer_recomputing_with_other_weights_than_the_slices_loaded_is_caught():
    rows = [
        LOAD0,
        *_run("a", 0),
        ("behaviour", dict(step=1, digests={"0": "OTHER"})),
        ("consume", dict(traj="a", group="g", version=0, step=1, trainer_version=1)),
    ]
    assert "version 0" in _one(rows, "weights").weights_violations[0]
    _one([LOAD0, ("load_version", dict(slice=1, version=0, digest="d1"))], "weights")


def _consume(traj, **source):
    return ("consume", dict(traj=traj, group="g", version=0, step=1, trainer_version=1, **source))


def test_rows_scored_by_a_rollout_slice_are_counted_and_their_digest_checked():
    """A consume whose behaviour log-probs a slice scored names the scoring params' digest: the
    version's digest passes, another one is a weights violation, none at all is one too; rows
    without the field count as the trainer's."""
    scored = dict(behaviour="rollout", behaviour_digest="d0")
    report = audit(
        _events(RUN, LOAD0, *_run("a", 0), *_run("b", 0), _consume("a", **scored), _consume("b", behaviour="trainer"))
    )
    assert report.ok, report.summary()
    assert (report.behaviour_rollout, report.behaviour_trainer, report.consumed) == (1, 1, 2)
    wrong = _one([LOAD0, *_run("a", 0), _consume("a", behaviour="rollout", behaviour_digest="OTHER")], "weights")
    assert wrong.weights_violations == ["version 0: the slice that scored a params OTHER, but slice 0 loaded params d0"]
    missing = _one([LOAD0, *_run("a", 0), _consume("a", behaviour="rollout")], "weights")
    assert missing.weights_violations == ["a: scored by a rollout slice with no params digest"]
    assert audit(_events(RUN, LOAD0, *_run("a", 0, trainer_version=1))).behaviour_trainer == 1


def test_rows_whose_behaviour_logps_are_their_sampling_logps_are_counted_apart():
    """trainer.behaviour_logps = "sampler": the consume says so, and the audit counts those rows
    apart from the trainer's and the slices' (their params are the ones their slice loaded)."""
    report = audit(
        _events(
            RUN,
            LOAD0,
            *_run("a", 0),
            *_run("b", 0),
            _consume("a", behaviour="sampler"),
            _consume("b", behaviour="sampler"),
        )
    )
    assert report.ok, report.summary()
    assert (report.behaviour_sampler, report.behaviour_rollout, report.behaviour_trainer) == (2, 0, 0)
