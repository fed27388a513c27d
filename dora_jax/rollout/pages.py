"""Which KV page each decode slot holds: the host side of the paged KV cache (dora_jax.models.paged).

The pool has `num_pages` pages of `page_size` rows; page 0 is scratch and never handed out. A slot
holds pages 0..n-1 of its page table for rows 0..n * page_size - 1. The host decides every
allocation, so every program gets its page table as an argument and the device never has to tell
the host anything: allocation cannot fall behind a pipelined decode loop.

Pages can be shared: `share` gives a slot another slot's full pages (a group's common prompt,
prefilled once) and counts references; a page is free again when its last holder lets go. A shared
page is never written: a slot's writes go to rows at or past its own length, and only pages
wholly below the prompt's length are shared (the page the samples diverge in is each slot's own).
"""

from __future__ import annotations

import numpy as np


class OutOfPages(RuntimeError):
    """The pool cannot give a slot the pages it needs now (the caller preempts, or waits)."""


class PagePool:
    def __init__(self, num_pages: int, page_size: int, num_slots: int, pages_per_slot: int):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}; expected >= 2 (page 0 is scratch)")
        self.num_pages, self.page_size = num_pages, page_size
        self.pages_per_slot = pages_per_slot
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low page numbers first
        self._refs = np.zeros((num_pages,), np.int32)
        self.table = np.zeros((num_slots, pages_per_slot), np.int32)  # 0 = scratch
        self.held = np.zeros((num_slots,), np.int32)
        self.revision = 0  # bumped on every table change (callers cache the device copy by it)

    # ------------------------------------------------------------------ queries
    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def capacity_pages(self) -> int:
        return self.num_pages - 1

    def pages_for(self, rows: int) -> int:
        return -(-rows // self.page_size)

    def shortfall(self, slot: int, rows: int) -> int:
        """Pages `slot` still needs to hold `rows` rows."""
        return max(0, self.pages_for(rows) - int(self.held[slot]))

    def pages(self, slot: int) -> np.ndarray:
        return self.table[slot, : self.held[slot]].copy()

    def releasable(self, slot: int) -> int:
        """Pages that would go back to the pool if `slot` let go (those nobody else holds)."""
        return int((self._refs[self.table[slot, : self.held[slot]]] == 1).sum())

    def live_pages(self) -> int:
        """The most pages any slot holds."""
        return int(self.held.max()) if self.held.size else 0

    # ------------------------------------------------------------------ changes
    def grow(self, slot: int, rows: int) -> None:
        """`slot` holds pages for `rows` rows (allocating what it lacks); OutOfPages if the pool
        cannot, with nothing allocated."""
        need = self.shortfall(slot, rows)
        if not need:
            return
        if self.pages_for(rows) > self.pages_per_slot:
            raise ValueError(
                f"{rows} rows need {self.pages_for(rows)} pages of {self.page_size}; a slot's page table "
                f"holds {self.pages_per_slot} (cache_length)"
            )
        if need > len(self._free):
            raise OutOfPages(f"slot {slot} needs {need} more pages for {rows} rows; {len(self._free)} are free")
        for _ in range(need):
            page = self._free.pop()
            self._refs[page] = 1
            self.table[slot, self.held[slot]] = page
            self.held[slot] += 1
        self.revision += 1

    def share(self, slot: int, source: int, full_pages: int) -> None:
        """`slot` (holding nothing) takes `source`'s first `full_pages` pages by reference."""
        if self.held[slot]:
            raise ValueError(f"slot {slot} holds {self.held[slot]} pages; release it before sharing into it")
        if full_pages > self.held[source]:
            raise ValueError(f"slot {source} holds {self.held[source]} pages; cannot share {full_pages}")
        pages = self.table[source, :full_pages]
        self.table[slot, :full_pages] = pages
        self.held[slot] = full_pages
        self._refs[pages] += 1
        self.revision += 1

    def release(self, slot: int) -> None:
        """`slot` lets go of its pages; a page nobody else holds goes back to the pool."""
        count = int(self.held[slot])
        if not count:
            return
        for page in self.table[slot, :count].tolist():
            self._refs[page] -= 1
            if not self._refs[page]:
                self._free.append(page)
        self.table[slot] = 0
        self.held[slot] = 0
        self.revision += 1
