"""Append-only files on Google Cloud Storage, where an object cannot be appended to.

A file P that grows by appends (the ledger, metrics.jsonl, TensorBoard events, logs) is, while
it is open for appending, a run of chunk objects beside it: `P.chunks/<first>-<last>` (ten digits
each) holds flushes `first..last` in order. Every flush of the writer becomes the next chunk
`P.chunks/<n>-<n>`, one object, so a reader sees a flush whole or not at all; every 32 chunks
are composed server-side into one `P.chunks/<first>-<last>` (GCS composes at most 32 objects) and
the pieces deleted; `close()` composes them all into the plain object P and deletes the chunks,
so a finished file is one object (`gcloud storage cat`, TensorBoard).

Readers (`read_blocks`) follow the chunks that cover 0, 1, 2, ... without a gap, the longest
first, so pieces that a crash left behind after a compose are never read twice; without such a
cover they read P. `close()` deletes its chunks in order, so once the first is gone P is the
whole file. A chunk deleted under a reader (the writer composed it meanwhile) makes the reader
list again and go on from the same byte offset. A writer that opens an existing P (a resumed
run) moves it back into chunk 0 first. One writer per file.

Uploads run on the writer's own thread, at most one per `min_interval_s` unless a caller waits
for one, so a coordinator that flushes every 0.2 s never blocks on the network except when it
asks for durability (`flush(wait=True)`, before a snapshot).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)

COMPOSE_MAX = 32  # source objects per GCS compose request
_CHUNK = re.compile(r"^(\d{10})-(\d{10})$")
_SUFFIX = ".chunks"


def chunk_dir(path: str) -> str:
    return path + _SUFFIX


def _chunk_name(path: str, first: int, last: int) -> str:
    return f"{chunk_dir(path)}/{first:010d}-{last:010d}"


def _list_chunks(fs, path: str) -> dict[tuple[int, int], int]:
    """{(first, last): size} of every chunk object of `path` (stale ones included)."""
    try:
        entries = fs.ls(chunk_dir(path), detail=True)
    except FileNotFoundError:
        return {}
    found = {}
    for entry in entries:
        match = _CHUNK.match(entry["name"].rsplit("/", 1)[-1])
        if match and entry.get("type") == "file":
            found[(int(match.group(1)), int(match.group(2)))] = int(entry["size"])
    return found


def _cover(chunks: dict[tuple[int, int], int]) -> list[tuple[int, int]]:
    """The chunks that hold flushes 0, 1, 2, ... in order, the longest first at each step."""
    longest: dict[int, int] = {}
    for first, last in chunks:
        longest[first] = max(last, longest.get(first, -1))
    cover, expected = [], 0
    while expected in longest:
        cover.append((expected, longest[expected]))
        expected = longest[expected] + 1
    return cover


def plan(fs, path: str) -> list[tuple[str, int]] | None:
    """The objects that hold `path`'s bytes, in order, with their sizes; None when it does not exist."""
    chunks = _list_chunks(fs, path)
    cover = _cover(chunks)
    if cover:
        return [(_chunk_name(path, first, last), chunks[(first, last)]) for first, last in cover]
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return None
    return [(path, int(info["size"]))] if info.get("type") == "file" else None


def read_blocks(fs, path: str, start: int = 0, *, attempts: int = 5) -> Iterator[bytes]:
    """`path`'s bytes from offset `start`, one object at a time."""
    offset = start
    for _ in range(attempts):
        objects = plan(fs, path)
        if objects is None:
            raise FileNotFoundError(f"{path}: no such file")
        skip = offset
        try:
            for name, size in objects:
                if skip >= size:
                    skip -= size
                    continue
                data = fs.cat_file(name, start=skip or None)
                skip = 0
                offset += len(data)
                yield data
            return
        except FileNotFoundError:
            continue  # composed under us: list again, go on from `offset`
    raise OSError(f"{path}: its chunks kept changing while being read ({attempts} attempts)")


def replace(fs, path: str, data: bytes) -> None:
    """Makes `data` the whole content of `path` (a truncation, a rewrite) without a moment at which
    a reader could see neither the old content nor the new: it becomes a chunk that covers every
    existing one, then the rest goes."""
    chunks = _list_chunks(fs, path)
    top = max((last for _, last in chunks), default=-1) + 1
    fs.pipe_file(_chunk_name(path, 0, top), data)
    _remove(fs, [path])
    _remove(fs, [_chunk_name(path, *c) for c in sorted(chunks)])
    _finish(fs, path, [(0, top)])


def drop_chunks(fs, path: str) -> None:
    """Deletes `path`'s chunks, in order (after a whole-object write of `path`)."""
    _remove(fs, [_chunk_name(path, *c) for c in sorted(_list_chunks(fs, path))])


def remove(fs, path: str) -> None:
    drop_chunks(fs, path)
    _remove(fs, [path])


def _is_object(fs, path: str) -> bool:
    try:
        return fs.info(path).get("type") == "file"
    except FileNotFoundError:
        return False


def _remove(fs, names: list[str]) -> None:
    for name in names:  # one at a time and in order: see close()
        try:
            fs.rm_file(name)
        except FileNotFoundError:
            pass


def _compose_head(fs, path: str, cover: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Composes the first (up to) 32 chunks of `cover` into one, deletes them; the new cover."""
    head = cover[:COMPOSE_MAX]
    names = [_chunk_name(path, *c) for c in head]
    merged = (head[0][0], head[-1][1])
    fs.merge(_chunk_name(path, *merged), names)
    _remove(fs, names)
    return [merged, *cover[COMPOSE_MAX:]]


def _finish(fs, path: str, cover: list[tuple[int, int]]) -> None:
    """Composes the chunks of `cover` into the object `path`, then deletes them in order."""
    while len(cover) > COMPOSE_MAX:  # only when composing failed on the way
        cover = _compose_head(fs, path, cover)
    names = [_chunk_name(path, *c) for c in cover]
    if names:
        fs.merge(path, names)
        _remove(fs, names)
    elif not _is_object(fs, path):
        fs.pipe_file(path, b"")


class Appender:
    """Appends to `path` on an object store (see the module docstring). `write` buffers; `flush`
    hands the buffer to the upload thread and, with `wait`, returns once everything written is
    stored (raising OSError if the upload failed); `close` stores the rest and composes the file."""

    def __init__(self, fs, path: str, *, min_interval_s: float = 1.0, retry_s: float = 1.0):
        self.path = path
        self._fs = fs
        self._interval, self._retry_s = min_interval_s, retry_s
        self._cover = self._adopt()
        self._next = self._cover[-1][1] + 1 if self._cover else 0
        self._buffer: list[bytes] = []
        self._pending: list[bytes] = []
        self._uploading = False
        self._waiters = 0
        self._closing = False
        self._error: BaseException | None = None
        self._last_upload = 0.0
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"append:{path.rsplit('/', 1)[-1]}", daemon=True)
        self._thread.start()

    def _adopt(self) -> list[tuple[int, int]]:
        """What is there already, as chunks; leftovers of a crash removed."""
        chunks = _list_chunks(self._fs, self.path)
        cover = _cover(chunks)
        stale = [c for c in sorted(chunks) if c not in cover]
        if cover:
            _remove(self._fs, [self.path])
            _remove(self._fs, [_chunk_name(self.path, *c) for c in stale])
            return cover
        _remove(self._fs, [_chunk_name(self.path, *c) for c in stale])
        if not _is_object(self._fs, self.path):
            return []
        self._fs.copy(self.path, _chunk_name(self.path, 0, 0))
        self._fs.rm_file(self.path)
        return [(0, 0)]

    # ------------------------------------------------------------------ the writer's side
    def write(self, data: str | bytes) -> int:
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        with self._cond:
            if self._closing:
                raise ValueError(f"write to a closed file ({self.path})")
            self._buffer.append(raw)
        return len(data)

    def flush(self, wait: bool = True) -> None:
        with self._cond:
            if self._buffer:
                self._pending.append(b"".join(self._buffer))
                self._buffer.clear()
                self._cond.notify_all()
            if not wait:
                return
            self._waiters += 1
            try:
                self._cond.notify_all()
                # Done, or an attempt failed and none is under way (gcsfs already retried it).
                self._cond.wait_for(
                    lambda: not (self._pending or self._uploading) or (self._error is not None and not self._uploading)
                )
            finally:
                self._waiters -= 1
            if self._error is not None and (self._pending or self._uploading):
                raise OSError(f"{self.path}: upload failed: {type(self._error).__name__}: {self._error}")

    def close(self) -> None:
        with self._cond:
            if self._closing:
                return
        self.flush(wait=True)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        _finish(self._fs, self.path, self._cover)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the upload thread
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closing)
                if not self._pending:
                    return
                due = self._last_upload + self._interval
                self._cond.wait_for(lambda: self._waiters or self._closing, timeout=max(0.0, due - time.monotonic()))
                data = b"".join(self._pending)
                self._pending.clear()
                self._uploading = True
            try:
                self._upload(data)
            except Exception as err:  # kept, retried; a waiting flush() raises it
                with self._cond:
                    self._pending.insert(0, data)
                    self._uploading, self._error = False, err
                    self._cond.notify_all()
                    if self._closing:
                        return
                time.sleep(self._retry_s)
                continue
            with self._cond:
                self._uploading, self._error = False, None
                self._last_upload = time.monotonic()
                self._cond.notify_all()

    def _upload(self, data: bytes) -> None:
        n = self._next
        self._fs.pipe_file(_chunk_name(self.path, n, n), data)  # raises: nothing changed, retried as n
        self._next += 1
        self._cover.append((n, n))
        if len(self._cover) >= COMPOSE_MAX:
            try:
                self._cover = _compose_head(self._fs, self.path, self._cover)
            except Exception as err:  # the chunks stay readable; composed after the next upload
                log.warning("%s: composing its chunks failed (%r); trying again later", self.path, err)
