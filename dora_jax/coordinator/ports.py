"""The transport seam between the coordinator and rollout slices.

The coordinator never touches an engine: it sends commands to a `RolloutPort` (in-process: a
worker thread's inbox; across processes: a gRPC stub) and receives finished trajectories as
events. Commands on one port are executed in order; each call returns once the worker has done it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from dora_jax.core.records import Reprefill, Request, SlotState

# An admitted request moves with its KV rows (SlotState) or to be re-prefilled (Reprefill); a
# queued one as is.
Migratable = SlotState | Reprefill | Request


class PortError(RuntimeError):
    """A slice is gone: its worker raised, hung past its deadline, or its process died. The
    coordinator re-dispatches what was on it; a port may raise any exception, this one says so."""


class RolloutPort(Protocol):
    slice_id: int
    num_slots: int

    def submit(self, requests: Sequence[Request]) -> None:
        """Queue requests on the slice (admitted into free slots as they open)."""

    def load_version(self, version: int) -> str | None:
        """Switch the slice's params to `version` (fetched from the ParamStore); no request may be on
        it. Returns the loaded params' digest (dora_jax.store.digest), written to the ledger."""

    def export(self, traj_ids: Sequence[str], kv: bool = True) -> list[Migratable]:
        """Remove these requests from the slice: admitted ones as SlotState (KV rows included) or,
        where re-prefilling costs less than moving their rows (or, with `kv=False`, always), as
        Reprefill; queued ones as Request. Ids that already finished are absent from the result."""

    def import_(self, items: Sequence[Migratable]) -> Sequence[str] | None:
        """Continue exported requests here: SlotStates with no prefill, Reprefills and Requests
        via the queue. Returns the ids of SlotStates re-prefilled here instead because their KV
        rows could not be had (a failed pull), or None when every one took its rows."""

    def progress(self) -> dict[str, Request]:
        """Every request on the slice as a Request carrying its tokens so far as a prefix, the
        slice untouched (checkpoints). A port without it resumes in-flight work from the prompt."""
