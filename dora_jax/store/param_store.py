"""The multi-version parameter store: the trainer publishes, rollout slices and the trainer read.

A `ParamStore` keeps the live window of policy versions (the trainer's step counter is the
version) and hands any of them out laid out for the reader's shardings. Where the bytes live is a
`Tier`: `InProcessTier` (device arrays, optional host offload of older versions; one process) or
`TensorStoreTier` (orbax zarr3 + OCDBT directories on local disk or `gs://`; any process that
opens the same directory can read). The store adds what both need: monotonic publish, pins held
by in-flight work and pending batches, retirement that never frees a pinned version, clear errors
and thread safety (one writer, many readers).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Protocol

Params = Any  # a nested dict of jax.Arrays
Shardings = Any  # a matching tree of jax.sharding.NamedSharding


class Tier(Protocol):
    """Where versions live. `write` is called once per version, by one writer at a time."""

    def write(self, version: int, params: Params) -> None: ...

    def read(self, version: int, shardings: Shardings, *, copy: bool = True) -> Params: ...

    def delete(self, version: int) -> None: ...

    def versions(self) -> tuple[int, ...]:
        """The committed versions, ascending (a half-written version is never listed)."""
        ...

    def bytes_by_tier(self) -> dict[str, int]: ...


class StoreError(KeyError):
    """A version that cannot be served (retired, never published, not newer on publish)."""

    def __str__(self) -> str:  # KeyError would print the message with quotes around it
        return str(self.args[0])


class ParamStore:
    """Monotonic publish, pinned reads and retirement over one `Tier`.

    Pins: `pin(v)` / `unpin(v)` count holders (in-flight requests, pending batches); `get` pins
    for the duration of the read itself. `retire_below(v)` frees every unpinned version < v now
    and remembers the watermark, so a pinned one is freed by its last `unpin`. The newest version
    is never retired.
    """

    def __init__(self, tier: Tier):
        self._tier = tier
        self._lock = threading.Lock()
        self._pins: collections.Counter[int] = collections.Counter()
        self._retired: set[int] = set()
        self._watermark = -1  # versions below it are freed once unpinned
        self._writing: int | None = None

    @property
    def tier(self) -> Tier:
        return self._tier

    # ---------------------------------------------------------------- writer
    def publish(self, version: int, params: Params) -> None:
        """Stores `params` as `version`, which must be newer than every version seen so far."""
        version = int(version)
        with self._lock:
            if self._writing is not None:
                raise StoreError(f"publish({version}) while version {self._writing} is being written: one writer only")
            newest = max(self._known(), default=None)
            if newest is not None and version <= newest:
                raise StoreError(f"publish({version}): versions must increase; the newest version is {newest}")
            self._writing = version
        try:
            self._tier.write(version, params)  # outside the lock: readers keep reading
        finally:
            with self._lock:
                self._writing = None

    def flush(self) -> None:
        """Waits until every published version is durable (a tier that writes in the background)."""
        flush = getattr(self._tier, "flush", None)
        if flush is not None:
            flush()

    # --------------------------------------------------------------- readers
    def get(self, version: int, shardings: Shardings, *, copy: bool = True) -> Params:
        """Version `version` laid out as `shardings` (a tree of NamedSharding matching params).

        The result is the caller's own (it may donate it) unless `copy=False`, which lets the
        in-process tier hand out its stored buffers where the layout already matches: only for a
        caller that never donates nor deletes what it gets (the trainer's log-prob recompute).
        """
        version = int(version)
        with self._lock:
            self._check_live(version)
            self._pins[version] += 1
        try:
            return self._tier.read(version, shardings, copy=copy)
        finally:
            self.unpin(version)

    def latest(self) -> int | None:
        live = self._tier.versions()
        return live[-1] if live else None

    def versions(self) -> tuple[int, ...]:
        return self._tier.versions()

    def bytes_by_tier(self) -> dict[str, int]:
        return self._tier.bytes_by_tier()

    # ------------------------------------------------------ pins and retiring
    def pin(self, version: int) -> None:
        version = int(version)
        with self._lock:
            self._check_live(version)
            self._pins[version] += 1

    def unpin(self, version: int) -> None:
        version = int(version)
        with self._lock:
            if self._pins[version] <= 0:
                del self._pins[version]
                raise StoreError(f"unpin({version}): version {version} is not pinned")
            self._pins[version] -= 1
            if self._pins[version] == 0:
                del self._pins[version]
                if version < self._watermark and version != self._newest():
                    self._free(version)

    def pins(self) -> dict[int, int]:
        with self._lock:
            return dict(self._pins)

    def retire_below(self, version: int) -> tuple[int, ...]:
        """Frees the unpinned versions < `version` (never the newest); returns those freed."""
        with self._lock:
            self._watermark = max(self._watermark, int(version))
            newest = self._newest()
            doomed = [v for v in self._tier.versions() if v < version and v != newest and not self._pins[v]]
            for v in doomed:
                self._free(v)
            return tuple(doomed)

    def rollback_to(self, version: int) -> tuple[int, ...]:
        """Deletes every version newer than `version` (a trainer resuming from an older checkpoint
        publishes those numbers again); refuses if one of them is pinned. Returns those deleted."""
        with self._lock:
            doomed = [v for v in self._tier.versions() if v > version]
            pinned = [v for v in doomed if self._pins[v]]
            if pinned:
                raise StoreError(f"rollback_to({version}): versions {pinned} are pinned")
            for v in doomed:
                self._tier.delete(v)
            self._retired = {v for v in self._retired if v <= version}
            return tuple(doomed)

    @contextlib.contextmanager
    def pinned(self, version: int) -> Iterator[int]:
        self.pin(version)
        try:
            yield version
        finally:
            self.unpin(version)

    # -------------------------------------------------------------- internals
    def _known(self) -> set[int]:
        return set(self._tier.versions()) | self._retired

    def _newest(self) -> int | None:
        live = self._tier.versions()
        return live[-1] if live else None

    def _free(self, version: int) -> None:
        self._tier.delete(version)
        self._retired.add(version)

    def _check_live(self, version: int) -> None:
        live = self._tier.versions()
        if version in live:
            return
        if version in self._retired or (live and version < live[0]):
            why = "was retired"
        elif version == self._writing:
            why = "is still being written"
        else:
            why = "was never published"
        raise StoreError(f"version {version} {why}; live versions: {list(live)}")
