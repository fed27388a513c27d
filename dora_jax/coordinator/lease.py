"""The workdir's writer lease: one coordinator at a time runs a workdir (appends to its ledger).

WORKDIR/coordinator.lease (through dora_jax.core.fs: a local file or a gs:// object) holds one JSON
object naming its holder and when it last beat:

    {"host": "vm-3", "pid": 4711, "id": "<32 hex>", "since": 1718000000.0,
     "heartbeat": 1718000042.5, "heartbeat_s": 10.0, "timeout_s": 60.0}

(`since` and `heartbeat`: seconds since the epoch, by the holder's clock). The holder rewrites it
every `heartbeat_s` from a thread. Another coordinator that finds it is refused by name
(`LeaseHeld`: which host and process hold it, since when, its last beat) while the holder lives,
and takes it over once the holder is dead: its heartbeat older than its `timeout_s`, or (same host)
its process gone. One whose holder has missed beats but is not yet past its timeout waits for the
outcome (up to that timeout) instead of refusing: a coordinator restarted right after a crash on
another host then starts without a retry. A takeover then resumes the run as before.

Object stores have no compare-and-swap in dora_jax.core.fs, so a claim is written and read back
after `settle_s`: of two coordinators that claim at once, the one whose claim was overwritten
backs off. A holder that finds another's claim at a beat has lost the lease (it stalled past its
timeout and was taken over): it stops beating and its `on_lost` is called.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

from dora_jax.core import fs

log = logging.getLogger(__name__)

LEASE_NAME = "coordinator.lease"
HEARTBEAT_S = 10.0
TIMEOUT_S = 60.0


class LeaseHeld(RuntimeError):
    """Another live coordinator holds the workdir."""


@dataclasses.dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    id: str
    since: float
    heartbeat: float
    heartbeat_s: float
    timeout_s: float

    def describe(self, now: float) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        return (
            f"coordinator pid {self.pid} on host {self.host!r} (lease {self.id[:8]}), since {since}, "
            f"last heartbeat {now - self.heartbeat:.1f}s ago"
        )


def _parse(data: bytes) -> Holder | None:
    """The lease's holder; None for an empty or unreadable lease (free to take)."""
    try:
        d = json.loads(data)
        return Holder(
            str(d["host"]),
            int(d["pid"]),
            str(d["id"]),
            float(d["since"]),
            float(d["heartbeat"]),
            float(d["heartbeat_s"]),
            float(d["timeout_s"]),
        )
    except (ValueError, KeyError, TypeError):
        return None


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class WriterLease:
    def __init__(
        self,
        workdir: str,
        *,
        heartbeat_s: float = HEARTBEAT_S,
        timeout_s: float = TIMEOUT_S,
        settle_s: float = 0.25,
        clock: Callable[[], float] = time.time,
        on_lost: Callable[[str], None] | None = None,
    ):
        """Takes nothing yet: `acquire()` does. `clock` is wall time (holders on other hosts
        compare it with theirs: the timeout must dwarf their clocks' skew)."""
        if not 0 < heartbeat_s < timeout_s:
            raise ValueError(f"heartbeat_s={heartbeat_s}, timeout_s={timeout_s}; expected 0 < heartbeat_s < timeout_s")
        self.path = fs.join(workdir, LEASE_NAME)
        self.host, self.pid, self.id = socket.gethostname(), os.getpid(), uuid.uuid4().hex
        self._heartbeat_s, self._timeout_s, self._settle_s = heartbeat_s, timeout_s, settle_s
        self._clock = clock
        self._on_lost = on_lost or (lambda why: log.error("%s", why))
        self._since = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost: str | None = None  # why, once another coordinator took the lease over

    @classmethod
    def acquire(cls, workdir: str, **kwargs) -> WriterLease:
        """A held lease on `workdir` (see the module docstring), or `LeaseHeld` naming its holder."""
        lease = cls(workdir, **kwargs)
        lease._take()
        return lease

    def _take(self) -> None:
        while True:
            holder = self._read()
            now = self._clock()
            if holder is not None and self._alive(holder, now):
                if now - holder.heartbeat <= 2 * holder.heartbeat_s:  # beating: it lives
                    raise LeaseHeld(
                        f"{self.path} is held by {holder.describe(now)}: another coordinator runs this "
                        f"workdir; stop it first (a dead one's lease expires {holder.timeout_s:g}s after its "
                        "last heartbeat)"
                    )
                time.sleep(min(self._heartbeat_s, max(holder.heartbeat + holder.timeout_s - now, 0.0) + 0.01))
                continue  # it missed beats: wait for it to beat again or to pass its timeout
            self._since = now
            self._write(now)
            time.sleep(self._settle_s)
            claim = self._read()
            if claim is not None and claim.id == self.id:
                break
            if claim is not None:  # another coordinator claimed it at the same moment, after us
                raise LeaseHeld(f"{self.path} was claimed at the same time by {claim.describe(self._clock())}")
        if holder is not None:
            log.warning("took the lease of %s over from %s", self.path, holder.describe(self._clock()))
        self._thread = threading.Thread(target=self._beat, name="writer-lease", daemon=True)
        self._thread.start()

    def _alive(self, holder: Holder, now: float) -> bool:
        if holder.id == self.id:
            return False
        if holder.host == self.host and not _process_alive(holder.pid):
            return False  # died on this host: no need to wait out its heartbeat
        return now - holder.heartbeat <= holder.timeout_s

    def _read(self) -> Holder | None:
        try:
            return _parse(fs.read_bytes(self.path))
        except FileNotFoundError:
            return None

    def _write(self, now: float) -> None:
        record = {
            "host": self.host,
            "pid": self.pid,
            "id": self.id,
            "since": self._since,
            "heartbeat": now,
            "heartbeat_s": self._heartbeat_s,
            "timeout_s": self._timeout_s,
        }
        with fs.open(self.path, "w", atomic=True) as f:
            f.write(json.dumps(record))

    def _beat(self) -> None:
        while not self._stop.wait(self._heartbeat_s):
            try:
                holder = self._read()
                if holder is not None and holder.id != self.id:
                    self.lost = f"the lease of {self.path} was taken over by {holder.describe(self._clock())}"
                    self._on_lost(self.lost)
                    return
                self._write(self._clock())
            except OSError as err:  # a passing storage error: the next beat tries again
                log.warning("heartbeat of %s failed: %s", self.path, err)

    def release(self) -> None:
        """Stops beating and removes the lease if it is still this coordinator's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        try:
            holder = self._read()
            if holder is not None and holder.id == self.id:
                fs.remove(self.path)
        except OSError as err:  # it expires by itself
            log.warning("could not remove %s: %s", self.path, err)

    def __enter__(self) -> WriterLease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
