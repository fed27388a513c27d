"""Slice commands that the coordinator's loop does not sit idle through.

A port call returns once the worker has done the command, at its next step boundary; a version
switch first reads and digests the version (a tenth of a second for the bench's tiny model, seconds
for billions of parameters on a pod). The loop used to wait for it: the results other slices
finished meanwhile stayed in the inbox, and the trainer, waiting for them to complete its batch,
waited as long. With `coordinator.apply_results_during_calls` (the default; the simulator's
instant ports call inline) a command runs on a thread of its own while the loop applies the
results that arrive (finished trajectories and rewards) and wakes the trainer. Every other event
(a publish, a take, a slice's failure) would change what the switching pass in progress planned:
it waits for the pass to end, in order.

Which results, and why the ledger stays in order: a load goes to an empty slice, and a submit's
dispatch lines are written before it. An export returns only what had not finished when the
worker ran it (it posts what finished first), so a result applied during it is one the pass would
have applied right after (`Coordinator._absorb`). An import's reply decides how its migrations are
written, so the destination's own results, which may be those of the requests it just took, wait
for those lines (`hold`). A snapshot's `progress` is read inline: the snapshot must match the
ledger as it stands.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from dora_jax.coordinator import events

CALLS = frozenset({"submit", "load_version", "export", "import_"})


def call(
    port: Any,
    method: str,
    args: Sequence[Any],
    inbox: queue.SimpleQueue,
    lock: threading.Condition,
    apply: Callable[[events.Event], None],
) -> tuple[Any, Exception | None]:
    """`port.method(*args)` on its own thread. The caller holds `lock`; it is released while the inbox is
    read and held while `apply(event)` runs on each event that arrives before the call is done
    (it applies a result, and keeps any other event for the loop, in order; what it raises is
    raised here). Returns (the call's result, None), or (None, the exception it raised)."""
    done = events.CallDone(object())
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((getattr(port, method)(*args), None))
        except BaseException as err:  # handed to the loop thread
            outcome.append((None, err))
        finally:
            inbox.put(done)

    threading.Thread(target=run, name="coordinator-port-call", daemon=True).start()
    while True:
        lock.release()
        try:
            event = inbox.get()
        finally:
            lock.acquire()
        if event is done:
            break
        apply(event)
    result, err = outcome[0]
    if err is not None and not isinstance(err, Exception):
        raise err  # not a failed command (an interrupt): as the call would have inline
    return result, err
