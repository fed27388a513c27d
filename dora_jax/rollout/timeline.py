"""A rollout slice's busy time as bars, for timelines that span processes.

Each decode step is (start, end, version, occupancy); consecutive steps of one version that follow
each other within `gap_s` are one bar, so a long run stays a few thousand bars. Times are
wall-clock seconds (`time.time()`): the bars of every process on one machine line up with the
trainer's steps and the ledger's events. A rollout worker writes its bars to
WORKDIR/timelines/rollout_<slice>.json when it stops (`bench modes` reads them; so can a plot of a
pod run)."""

from __future__ import annotations

import dataclasses
import json

from dora_jax.core import fs


class BusyTimeline:
    def __init__(self, gap_s: float = 0.01):
        self.gap_s = gap_s
        self.bars: list[list] = []  # [start, end, version, mean occupancy, steps]

    def step(self, start: float, end: float, version: int | None, occupancy: float) -> None:
        last = self.bars[-1] if self.bars else None
        if last is not None and last[2] == version and start - last[1] < self.gap_s:
            steps = last[4] + 1
            last[1] = end
            last[3] += (occupancy - last[3]) / steps
            last[4] = steps
        else:
            self.bars.append([start, end, version, occupancy, 1])

    @property
    def busy_s(self) -> float:
        return sum(bar[1] - bar[0] for bar in self.bars)


def write(workdir: str, slice_id: int, timeline: BusyTimeline, counters) -> None:
    """WORKDIR/timelines/rollout_<slice>.json: the slice's bars and its worker's counters at the end
    (WorkerCounters)."""
    record = {
        "slice_id": slice_id,
        "clock": "time.time",
        "bars": timeline.bars,
        "counters": dataclasses.asdict(counters),
    }
    directory = fs.join(workdir, "timelines")
    fs.makedirs(directory)
    with fs.open(fs.join(directory, f"rollout_{slice_id}.json"), "w") as f:
        json.dump(record, f)


def read(workdir: str) -> list[dict]:
    """Every slice's record under WORKDIR/timelines, by slice id."""
    directory = fs.join(workdir, "timelines")
    if not fs.exists(directory):
        return []
    records = []
    for name in sorted(fs.listdir(directory)):
        if name.startswith("rollout_") and name.endswith(".json"):
            with fs.open(fs.join(directory, name)) as f:
                records.append(json.load(f))
    return sorted(records, key=lambda r: r["slice_id"])
