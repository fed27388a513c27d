"""The trajectory ledger: one JSON object per line, appended and flushed as things happen.

A crash leaves at most a torn last line, which `read_ledger` skips. Events and their minimum
fields are listed in DESIGN.md ("The contracts"); `resume` voids the lines between its
`ledger_offset` and itself.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Iterator


class Ledger:
    """Append-only JSON-lines writer; thread-safe; every line is flushed (and optionally fsynced)."""

    def __init__(self, path: str | None, *, fsync: bool = False, clock=time.time):
        self.path = path
        self._fsync = fsync
        self._clock = clock
        self._lock = threading.Lock()
        self._file = open(path, "a", encoding="utf-8") if path else None
        self.lines_written = 0
        self.memory: list[dict] = []  # every event of this process, for in-process inspection

    def write(self, ev: str, **fields: Any) -> dict:
        event = {"ev": ev, **fields, "t": round(self._clock(), 6)}
        line = json.dumps(event, separators=(",", ":"))
        with self._lock:
            self.memory.append(event)
            if self._file is not None:
                self._file.write(line + "\n")
                self._file.flush()
                if self._fsync:
                    os.fsync(self._file.fileno())
            self.lines_written += 1
        return event

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_ledger(path: str) -> Iterator[dict]:
    """Yields the complete events of a ledger file; a torn (unparseable) last line is skipped."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    complete, tail = lines[:-1], lines[-1]
    for number, line in enumerate(complete, start=1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not a JSON event ({err.msg}); the ledger is corrupt") from None
    if tail.strip():  # no trailing newline: the writer died mid-line; ignore it
        try:
            yield json.loads(tail)
        except json.JSONDecodeError:
            return
