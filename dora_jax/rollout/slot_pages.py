"""Which pages the engine's decode slots hold and where each writes next: the host-side bookkeeping
of one live paged decode state (`SlotPages`), over the page pool (`rollout/pages.py`).

The host decides every allocation before the program that needs it runs: `claim` before an insert
(a slot lets go of its pages and takes those of its prefix and its pending token's row, sharing
another slot's whole pages below a common prompt), `grow_for_step` before a decode step (a new
page every page_size steps), `release` when a request leaves. Every refusal is OutOfPages with
nothing changed; the `*_shortfall` queries say beforehand how many pages a change lacks, so the
caller can preempt or wait first. No device work here: the device page table is placed by the
caller's `put`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dora_jax.models.paged import SCRATCH_PAGE
from dora_jax.rollout.engine_config import EngineConfig
from dora_jax.rollout.pages import OutOfPages, PagePool


class SlotPages:
    """The page pool of one live decode state and each occupied slot's next row.

    `live_widths`: the page-table widths a decode step runs at (ascending; the widest is the whole
    table); `device_table` gives the narrowest that holds every occupied slot's pages."""

    def __init__(self, config: EngineConfig, live_widths: Sequence[int]):
        if not config.paged:
            raise ValueError("SlotPages needs a paged EngineConfig (page_size > 0)")
        self.config, self.live_widths = config, tuple(live_widths)
        self.pool = PagePool(config.pool_pages, config.page_size, config.num_slots, config.pages_per_slot)
        self.position = np.zeros((config.num_slots,), np.int64)  # the row each active slot writes next
        self.active = np.zeros((config.num_slots,), bool)
        self._table: tuple[tuple[int, int], Any] | None = None  # ((revision, width), device table)

    # ------------------------------------------------------------------ queries
    def growing(self, skip: int = -1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(slots, their rows after the next step, pages each lacks for them) of the occupied slots
        but `skip` (numpy over the slots: this runs before every decode step)."""
        active = np.flatnonzero(self.active & (np.arange(self.config.num_slots) != skip))
        rows = np.minimum(self.position[active] + 1, self.config.cache_length)
        lacking = np.maximum(0, -(-rows // self.config.page_size) - self.pool.held[active])
        return active, rows, lacking

    def decoding_shortfall(self, skip: int = -1) -> int:
        """Pages the occupied slots but `skip` lack for the next decode step."""
        return int(self.growing(skip)[2].sum())

    def step_shortfall(self) -> int:
        """Pages the next decode step needs beyond those free (> 0: `grow_for_step` would raise)."""
        return max(0, self.decoding_shortfall() - self.pool.free_pages)

    def admit_shortfall(self, slot: int, tokens: int, *, reserved: int = 0) -> int:
        """Pages short of admitting `tokens` prefilled tokens into `slot` now while keeping the
        pages the other slots' next step needs and `reserved` pages promised to requests admitted
        with it (0: admit)."""
        need = self.pages_for_prefill(tokens) + self.decoding_shortfall(skip=slot) + reserved
        return max(0, need - self.pool.free_pages)

    def pages_for_prefill(self, tokens: int) -> int:
        """Pages a slot takes for `tokens` prefilled tokens and its pending token's row."""
        return self.pool.pages_for(min(tokens + 1, self.config.cache_length))

    def shareable(self, source: int, tokens: int) -> int:
        """Whole pages of occupied slot `source` below a prompt of `tokens` tokens that a new slot
        may share (0: none, or no prefill bucket fits after them)."""
        if not self.active[source] or tokens > self.config.max_prefill_length:
            return 0  # (a prompt past one prefill chunk is prefilled whole: its buckets are warm)
        N = self.config.page_size
        shared = min((tokens - 1) // N, int(self.pool.held[source]))
        if shared < 1 or shared * N + self.config.min_prefill_bucket > self.config.cache_length:
            return 0
        return shared

    def page_row(self, slot: int, width: int) -> np.ndarray:
        """The slot's first `width` page-table entries (0 = scratch past what it holds)."""
        row = np.zeros((width,), np.int32)
        held = self.pool.pages(slot)[:width]
        row[: len(held)] = held
        return row

    def write_row(self, slot: int, rows: int, shared: int) -> np.ndarray:
        """The pages `rows` rows written for `slot` go to; its shared pages are never written: their
        rows go to scratch."""
        pages_Q = self.page_row(slot, rows // self.config.page_size)
        pages_Q[:shared] = SCRATCH_PAGE
        return pages_Q

    def device_table(self, put: Callable[[np.ndarray], Any]) -> Any:
        """Every slot's page table, as wide as the narrowest live width holding the occupied slots'
        pages, placed by `put`; the placed copy is reused until the table or the width changes."""
        live = max(1, max((int(self.pool.held[s]) for s in np.flatnonzero(self.active)), default=1))
        width = next(w for w in self.live_widths if w >= live)
        key = (self.pool.revision, width)
        if self._table is None or self._table[0] != key:
            self._table = (key, put(self.pool.table[:, :width]))
        return self._table[1]

    # ------------------------------------------------------------------ changes
    def release(self, slot: int) -> None:
        """`slot` lets go of its pages (its later garbage steps write to scratch)."""
        self.pool.release(slot)
        self.active[slot] = False

    def shared_pages(self, slot: int, length: int, shared_from: int | None) -> int:
        """Whole pages below a prompt of `length` rows that `slot` would take from `shared_from`."""
        if shared_from is None:
            return 0
        if shared_from == slot or not self.active[shared_from]:
            raise ValueError(f"shared_from={shared_from}: expected another occupied slot than {slot}")
        return min((length - 1) // self.config.page_size, int(self.pool.held[shared_from]))

    def claim(self, slot: int, length: int, shared_from: int | None) -> int:
        """The host side of an insert: `slot` lets go of its pages and takes pages for `length`
        rows and its pending token's, sharing `shared_from`'s whole pages below them (OutOfPages,
        nothing changed, when the pool lacks them). Returns the pages shared."""
        rows_held = min(length + 1, self.config.cache_length)  # its rows and its pending token's
        shared = self.shared_pages(slot, length, shared_from)
        need = self.pool.pages_for(rows_held) - shared
        if need > self.pool.free_pages + self.pool.releasable(slot):
            raise OutOfPages(
                f"slot {slot}: a prefix of {length} tokens needs {need} pages; {self.pool.free_pages} are free"
            )
        self.pool.release(slot)
        if shared:
            self.pool.share(slot, shared_from, shared)
        self.pool.grow(slot, rows_held)
        self.position[slot], self.active[slot] = length, True
        return shared

    def claim_all(self, claims: Sequence[tuple[int, int, int | None]]) -> list[int]:
        """`claim` of every (slot, length, shared_from) in order, after checking the pool holds them
        all (OutOfPages, nothing changed, when it does not); a claim may share the pages of an
        occupied slot or of an earlier claim's. Returns the pages each shared."""
        pool, held, need = self.pool, {}, 0
        for slot, length, source in claims:
            if source is not None and source not in held and (source == slot or not self.active[source]):
                raise ValueError(f"shared_from={source}: expected another occupied slot or an earlier request's")
            full = pool.pages_for(min(length + 1, self.config.cache_length))
            donor = held.get(source, 0 if source is None else int(pool.held[source]))
            need += full - (0 if source is None else min((length - 1) // self.config.page_size, donor))
            held[slot] = full
        free = pool.free_pages + sum(pool.releasable(slot) for slot in held)
        if need > free:
            raise OutOfPages(f"{len(claims)} prefills need {need} pages; {free} are free or freed by their slots")
        return [self.claim(slot, length, source) for slot, length, source in claims]

    def grow_for_step(self) -> np.ndarray:
        """Before a decode step: every occupied slot takes the page its next row lands in (OutOfPages,
        nothing changed, if the pool lacks them). Returns the occupied slots (`stepped` takes them)."""
        if self.step_shortfall():
            raise OutOfPages(
                f"the next decode step needs {self.decoding_shortfall()} more pages; {self.pool.free_pages} are free"
            )
        active, rows, lacking = self.growing()
        for slot, n in zip(active[lacking > 0].tolist(), rows[lacking > 0].tolist()):  # a new page every N steps
            self.pool.grow(slot, n)
        return active

    def stepped(self, active: np.ndarray) -> None:
        """After a decode step: the `active` slots write their next row one further."""
        self.position[active] = np.minimum(self.position[active] + 1, self.config.cache_length - 1)
