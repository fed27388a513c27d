"""A rollout slice's busy bars: consecutive steps of one version coalesce, and the record a rollout
worker writes reads back (locally and on gs://)."""

import pytest

from dora_jax.rollout import timeline
from dora_jax.rollout.timeline import BusyTimeline
from dora_jax.rollout.worker import WorkerCounters


def test_steps_of_one_version_coalesce_into_bars_with_their_mean_occupancy():
    bars = BusyTimeline(gap_s=0.01)
    bars.step(0.000, 0.010, 3, 1.0)
    bars.step(0.015, 0.025, 3, 0.5)  # 5 ms later: the same bar
    bars.step(0.025, 0.030, 3, 0.0)
    bars.step(0.030, 0.040, 4, 1.0)  # a new version: a new bar
    bars.step(0.100, 0.110, 4, 0.25)  # 60 ms idle: a new bar
    assert [b[2] for b in bars.bars] == [3, 4, 4]
    first = bars.bars[0]
    assert first[:2] == [0.0, 0.030] and first[3] == pytest.approx(0.5) and first[4] == 3
    assert bars.bars[2] == [0.100, 0.110, 4, 0.25, 1]
    assert bars.busy_s == pytest.approx(0.030 + 0.010 + 0.010)


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_the_record_reads_back_by_slice(where, tmp_path, request):
    workdir = str(tmp_path) if where == "local" else request.getfixturevalue("gcs_root")
    assert timeline.read(workdir) == []
    for sid in (1, 0):
        bars = BusyTimeline()
        bars.step(10.0 + sid, 11.0 + sid, 0, 0.75)
        timeline.write(workdir, sid, bars, WorkerCounters(slot_steps=16, idle_slot_steps=4))
    records = timeline.read(workdir)
    assert [r["slice_id"] for r in records] == [0, 1]
    assert records[1]["bars"] == [[11.0, 12.0, 0, 0.75, 1]]
    assert records[0]["counters"]["slot_steps"] == 16 and records[0]["counters"]["idle_slot_steps"] == 4
