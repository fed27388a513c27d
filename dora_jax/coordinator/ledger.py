"""The trajectory ledger: one JSON object per line, appended as things happen.

Lines are flushed to the file at least every `flush_interval_s` (0: every line), and always
before a coordinator snapshot (`flush()`), so a checkpoint's `ledger_offset` never counts a line
that is not in the file. A crash loses at most the lines of the last interval, all after the last
checkpoint (a resume voids them anyway), and leaves at most a torn last line, which `read_ledger`
skips. Flushing every line cost the coordinator 7x its in-memory time at 64 accelerators
(dora_jax.sim, issue 22). Events and their minimum fields are listed in DESIGN.md ("The
contracts"); `resume` voids the lines between its `ledger_offset` and itself.

The file goes through dora_jax.core.fs: a local path is a plain file; on `gs://` (which cannot
append) each interval's lines become the next chunk object, uploaded off the coordinator's thread
at most once a second (so a crash there loses up to a second of lines) and composed into one
object at close (dora_jax.core.object_log), and `flush()` waits until they
are stored, so a snapshot's `ledger_offset` holds there too. Chunks are whole lines: a GCS ledger
has no torn line.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

from dora_jax.core import fs


class Ledger:
    """Append-only JSON-lines writer; thread-safe; flushed every `flush_interval_s` and on
    `flush()` (then optionally fsynced)."""

    def __init__(self, path: str | None, *, fsync: bool = False, clock=time.time, flush_interval_s: float = 0.2):
        self.path = path
        self._clock = clock
        self._interval = flush_interval_s
        self._flushed_at = time.monotonic()
        self._lock = threading.Lock()
        existing = 0
        if path and fs.exists(path):
            existing = sum(block.count(b"\n") for block in fs.read_blocks(path))
        self._file = fs.open(path, "a", fsync=fsync) if path else None
        self.lines_written = existing  # lines in the file, so a checkpoint's offset is absolute
        self.memory: list[dict] = []  # every event of this process, for in-process inspection

    def write(self, ev: str, **fields: Any) -> dict:
        event = {"ev": ev, **fields, "t": round(self._clock(), 6)}
        line = json.dumps(event, separators=(",", ":")) if self._file is not None else ""
        with self._lock:
            self.memory.append(event)
            if self._file is not None:
                self._file.write(line + "\n")
                if time.monotonic() - self._flushed_at >= self._interval:
                    self._flush_locked(wait=False)
            self.lines_written += 1
        return event

    def flush(self) -> None:
        """Every line written so far reaches the file (and the disk, with `fsync`; the bucket, on GCS)."""
        with self._lock:
            if self._file is not None:
                self._flush_locked(wait=True)

    def flush_if_due(self) -> None:
        """Flushes when the interval has passed since the last flush (for a quiet stretch); on GCS
        without waiting for the upload."""
        if self._file is not None and time.monotonic() - self._flushed_at >= self._interval:
            with self._lock:
                if self._file is not None:
                    self._flush_locked(wait=False)

    def _flush_locked(self, wait: bool) -> None:
        self._file.flush(wait=wait)  # local: flushed (and fsynced) either way; GCS: stored only with `wait`
        self._flushed_at = time.monotonic()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_ledger(path: str, torn: list | None = None) -> Iterator[dict]:
    """Yields the complete events of a ledger file.

    A line that does not parse is a write torn by a crash (the last line, or the last line before
    a `resume`); it is skipped and, when `torn` is given, its line number appended to it.
    """
    for number, line in enumerate(_lines(fs.read_blocks(path)), start=1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            if torn is not None:
                torn.append(number)


def _lines(blocks: Iterator[bytes]) -> Iterator[bytes]:
    """The lines of a stream of blocks (a line may span blocks); the last one without its newline."""
    rest = b""
    for block in blocks:
        *lines, rest = (rest + block).split(b"\n")
        yield from lines
    if rest:
        yield rest


def repair_torn_tail(path: str) -> int:
    """Truncates a torn last line (no trailing newline) so appends start on a fresh line; returns
    the number of complete lines kept."""
    data = fs.read_bytes(path)
    keep = data.rfind(b"\n") + 1
    if keep != len(data):
        fs.truncate(path, keep)
    return data[:keep].count(b"\n")
