"""The ledger's buffering: lines reach the file by the interval, and always before a snapshot."""

import json

from dora_jax.coordinator.ledger import Ledger, read_ledger
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
