"""The engine's page bookkeeping on its own (dora_jax/rollout/slot_pages.py): claims, releases and
reuse, decode steps growing slots a page at a time, sharing a prompt's pages, and OutOfPages with
nothing changed when the pool runs dry."""

from __future__ import annotations

import numpy as np
import pytest

from dora_jax.rollout.engine_config import EngineConfig
from dora_jax.rollout.pages import OutOfPages
from dora_jax.rollout.slot_pages import SlotPages

# 3 slots of up to 32 rows in pages of 4 rows: 8 pages a slot, a pool of 8 pages (+ scratch page 0).
ROOMY = EngineConfig(
    num_slots=3, cache_length=32, max_prefill_length=16, min_prefill_bucket=8, page_size=4, num_pages=9
)
# 2 slots of up to 16 rows in pages of 4: 4 pages a slot, a pool of 4 pages (+ scratch).
TIGHT = EngineConfig(num_slots=2, cache_length=16, max_prefill_length=8, min_prefill_bucket=8, page_size=4, num_pages=5)


def _slots(config: EngineConfig) -> SlotPages:
    return SlotPages(config, config.live_page_buckets)


def test_a_claim_takes_pages_for_its_rows_and_pending_row_and_a_release_gives_them_back_for_reuse():
    slots = _slots(ROOMY)
    assert slots.pool.free_pages == 8
    assert slots.claim(0, 9, None) == 0  # 9 rows + the pending token's: 10 rows, 3 pages
    assert list(slots.pool.pages(0)) == [1, 2, 3] and slots.pool.free_pages == 5
    assert slots.position[0] == 9 and slots.active[0]
    slots.claim(1, 4, None)  # 5 rows: 2 pages
    assert list(slots.pool.pages(1)) == [4, 5] and slots.pool.free_pages == 3
    slots.release(0)
    assert slots.pool.free_pages == 6 and not slots.active[0] and len(slots.pool.pages(0)) == 0
    slots.claim(2, 11, None)  # 12 rows: 3 pages, the ones slot 0 gave back
    assert sorted(slots.pool.pages(2)) == [1, 2, 3] and slots.pool.free_pages == 3
    slots.claim(1, 12, None)  # a slot claimed again lets go of its own 2 pages first: 13 rows, 4 pages
    assert len(slots.pool.pages(1)) == 4 and slots.pool.free_pages == 1


def test_a_claim_the_pool_cannot_hold_raises_out_of_pages_and_changes_nothing():
    slots = _slots(ROOMY)
    slots.claim(0, 9, None)
    slots.claim(1, 9, None)  # 6 of 8 pages taken
    revision = slots.pool.revision
    with pytest.raises(OutOfPages, match="slot 2: a prefix of 15 tokens needs 4 pages; 2 are free"):
        slots.claim(2, 15, None)
    assert slots.pool.free_pages == 2 and slots.pool.held[2] == 0 and not slots.active[2]
    assert slots.pool.revision == revision
    slots.claim(2, 7, None)  # 8 rows: the 2 pages left fit
    assert slots.pool.free_pages == 0


def test_decode_steps_grow_a_slot_a_page_at_a_time_until_the_pool_runs_dry():
    slots = _slots(TIGHT)
    slots.claim(0, 3, None)  # 4 rows: 1 page
    slots.claim(1, 7, None)  # 8 rows: 2 pages
    assert slots.pool.free_pages == 1 and slots.step_shortfall() == 0
    active = slots.grow_for_step()  # both still inside their pages: nothing taken
    assert list(active) == [0, 1] and slots.pool.free_pages == 1
    slots.stepped(active)
    assert list(slots.position) == [4, 8]
    # the next step writes row 4 of slot 0 and row 8 of slot 1: a new page each, one is free
    assert slots.decoding_shortfall() == 2 and slots.step_shortfall() == 1
    with pytest.raises(OutOfPages, match="the next decode step needs 2 more pages; 1 are free"):
        slots.grow_for_step()
    assert slots.pool.free_pages == 1 and list(slots.pool.held) == [1, 2]  # nothing taken
    slots.release(1)  # the caller preempts one
    assert slots.step_shortfall() == 0
    assert list(slots.grow_for_step()) == [0]
    assert list(slots.pool.held) == [2, 0] and slots.pool.free_pages == 2


def test_admission_keeps_the_pages_the_other_slots_next_step_needs():
    slots = _slots(TIGHT)
    slots.claim(0, 4, None)  # 5 rows: 2 pages; its next step stays in them
    assert slots.pages_for_prefill(7) == 2  # 7 tokens and the pending token's row
    assert slots.admit_shortfall(1, 7) == 0  # 2 free, 2 needed
    assert slots.admit_shortfall(1, 7, reserved=1) == 1  # a page promised to another admission
    assert slots.admit_shortfall(1, 8) == 1  # 9 rows: 3 pages
    for _ in range(4):  # four decode steps inside its 2 pages
        slots.stepped(slots.grow_for_step())
    assert slots.position[0] == 8 and slots.pool.free_pages == 2  # its next step needs a third page
    assert slots.admit_shortfall(1, 7) == 1
    assert slots.pages_for_prefill(40) == 4  # capped at cache_length's pages


def test_a_shared_prompt_keeps_its_pages_until_its_last_holder_lets_go():
    slots = _slots(ROOMY)
    slots.claim(0, 9, None)  # pages 1, 2, 3
    assert slots.shareable(0, 9) == 2  # the whole pages below the prompt's end
    assert slots.shareable(0, 4) == 0  # no whole page below it
    assert slots.shareable(0, 17) == 0  # past one prefill chunk
    assert slots.shareable(1, 9) == 0  # slot 1 holds nothing
    assert slots.claim(1, 9, shared_from=0) == 2  # takes pages 1 and 2, and one of its own
    assert list(slots.pool.pages(1)) == [1, 2, 4] and slots.pool.free_pages == 4
    assert list(slots.write_row(1, 16, 2)) == [0, 0, 4, 0]  # shared pages are never written: scratch
    slots.release(0)  # only page 3 was slot 0's alone
    assert slots.pool.free_pages == 5 and list(slots.pool.pages(1)) == [1, 2, 4]
    with pytest.raises(ValueError, match="shared_from=0: expected another occupied slot than 2"):
        slots.claim(2, 9, shared_from=0)  # slot 0 no longer occupied
    with pytest.raises(ValueError, match="shared_from=1: expected another occupied slot than 1"):
        slots.claim(1, 9, shared_from=1)


def test_claim_all_is_all_or_nothing_and_may_share_an_earlier_claims_pages():
    slots = _slots(ROOMY)
    assert slots.claim_all([(0, 9, None), (1, 9, 0), (2, 9, 0)]) == [0, 2, 2]
    assert slots.pool.free_pages == 8 - 3 - 1 - 1
    revision = slots.pool.revision
    # 4 pages each; free: 3, plus one page each slot alone holds (pages 1 and 2 are held thrice)
    with pytest.raises(OutOfPages, match="3 prefills need 12 pages; 6 are free or freed by their slots"):
        slots.claim_all([(0, 15, None), (1, 15, None), (2, 15, None)])
    assert slots.pool.free_pages == 3 and slots.pool.revision == revision
    with pytest.raises(ValueError, match="shared_from=2: expected another occupied slot or an earlier request's"):
        _slots(ROOMY).claim_all([(0, 9, 2)])


def test_the_device_table_is_as_wide_as_the_live_pages_and_placed_again_only_when_it_changes():
    slots = _slots(ROOMY)
    placed = []

    def put(table):
        placed.append(np.array(table))
        return len(placed)

    assert slots.device_table(put) == 1 and placed[0].shape == (3, 1)  # nothing live: the narrowest
    assert slots.device_table(put) == 1  # unchanged: the placed copy again
    slots.claim(1, 9, None)  # 3 pages live: width 4
    assert slots.device_table(put) == 2
    assert placed[1].tolist() == [[0, 0, 0, 0], [1, 2, 3, 0], [0, 0, 0, 0]]
    assert slots.device_table(put) == 2 and len(placed) == 2


def test_a_dense_config_has_no_pages_to_keep():
    with pytest.raises(ValueError, match="paged EngineConfig"):
        SlotPages(EngineConfig(num_slots=2, cache_length=16, max_prefill_length=8, min_prefill_bucket=8), (1,))
