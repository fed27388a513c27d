"""The paged KV cache in the engine and worker: the same tokens and log-probs as the dense cache
(pipelined or not), a pool smaller than every slot at full length admits by free pages and
preempts the youngest request when it runs dry without changing a token, every page comes back,
no program compiles after warm-up, and bad sizes are refused naming the fields."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dora_jax.core.records import Request, SamplingParams
from dora_jax.rollout.engine import EngineConfig, RolloutEngine
from dora_jax.rollout.pages import OutOfPages, PagePool
from dora_jax.rollout.worker import RolloutWorker
from tests.rollout.conftest import PAGED, TINY, run_to_end, warm


def _requests(n=10):
    return [
        Request(
            f"t{i}",
            "g",
            f"p{i}",
            tuple((3 * i + j) % TINY.vocab_size for j in range(3 + 3 * i)),
            0,
            20 + i,
            SamplingParams(temperature=1.0, top_p=0.9 if i % 3 == 0 else 1.0, seed=i),
        )
        for i in range(n)
    ]


def _run(engine, tiny_params, *, pipelined=True, requests=None):
    worker = RolloutWorker(engine, eos_ids=(), pipelined=pipelined)
    worker.load_version(0, tiny_params)
    for request in requests or _requests():
        worker.submit(request)
    done = run_to_end(worker)
    return done, worker


@pytest.fixture(scope="module")
def dense_reference(engine, tiny_params):
    return _run(warm(engine, tiny_params), tiny_params)[0]


@pytest.fixture(scope="module")
def small_pool_engine(slices, tiny_params):
    """12 pages of 8 rows (+ scratch): 96 rows for 4 slots of up to 64, so requests wait and are preempted."""
    engine = RolloutEngine(TINY, dataclasses.replace(PAGED, num_pages=13), slices.rollout[0])
    engine.warmup(engine.load_params(tiny_params))
    return engine


def _assert_same(done, reference):
    assert done.keys() == reference.keys()
    for traj_id, ref in reference.items():
        assert done[traj_id].response_ids == ref.response_ids, traj_id
        np.testing.assert_allclose(done[traj_id].logprobs, ref.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("pipelined", [True, False])
def test_paged_worker_equals_the_dense_worker(paged_engine, tiny_params, dense_reference, pipelined):
    done, worker = _run(paged_engine, tiny_params, pipelined=pipelined)
    _assert_same(done, dense_reference)
    assert worker.counters.preemptions == 0
    assert paged_engine.pages.free_pages == paged_engine.pages.capacity_pages


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_small_pool_preempts_and_resumes_without_changing_a_token(
    small_pool_engine, tiny_params, dense_reference, pipelined
):
    counts = small_pool_engine.compile_counts()
    done, worker = _run(small_pool_engine, tiny_params, pipelined=pipelined)
    _assert_same(done, dense_reference)
    assert worker.counters.preemptions > 0  # the pool ran dry mid-decode and the youngest went back
    assert worker.counters.prefills == 10 + worker.counters.preemptions  # each preempted one re-prefilled once
    pool = small_pool_engine.pages
    assert pool.free_pages == pool.capacity_pages == 12
    assert small_pool_engine.compile_counts() == counts  # re-prefills and every page-table width were warm


def test_admission_waits_for_pages_and_never_overfills_the_pool(small_pool_engine, tiny_params):
    worker = RolloutWorker(small_pool_engine, eos_ids=())
    worker.load_version(0, tiny_params)
    long_prompt = tuple(range(1, 40))  # 40 rows with its pending token: 5 of the 12 pages
    for i in range(4):
        worker.submit(Request(f"l{i}", "g", f"p{i}", long_prompt, 0, 8, SamplingParams(temperature=0.0)))
    worker.step()
    assert worker.num_active == 2 and worker.num_queued == 2  # a third would leave no page for the next step
    pool = small_pool_engine.pages
    assert pool.free_pages >= 0 and int(pool.held.sum()) <= pool.capacity_pages
    done = run_to_end(worker)
    assert len(done) == 4 and all(len(t.response_ids) == 8 for t in done.values())


def test_page_pool_shares_pages_by_reference():
    pool = PagePool(num_pages=9, page_size=4, num_slots=3, pages_per_slot=4)
    pool.grow(0, 10)  # 3 pages
    assert pool.free_pages == 5 and list(pool.pages(0)) == [1, 2, 3]
    pool.share(1, 0, full_pages=2)
    pool.grow(1, 9)  # its own third page
    assert list(pool.pages(1))[:2] == [1, 2] and pool.pages(1)[2] not in (1, 2, 3)
    assert pool.releasable(1) == 1
    pool.release(0)  # pages 1 and 2 stay: slot 1 holds them
    assert pool.free_pages == 5
    pool.release(1)
    assert pool.free_pages == 8
    pool.grow(0, 16)
    pool.grow(1, 12)
    with pytest.raises(OutOfPages, match="slot 2 needs 3 more pages for 12 rows; 1 are free"):
        pool.grow(2, 12)
    assert pool.free_pages == 1 and not pool.held[2]  # nothing taken by the refused grow


def test_bad_page_sizes_name_the_fields():
    base = dict(num_slots=4, cache_length=64, max_prefill_length=32, min_prefill_bucket=16)
    with pytest.raises(ValueError, match="engine.page_size=12; expected 0 .dense. or a power of two"):
        EngineConfig(**base, page_size=12)
    with pytest.raises(ValueError, match="engine.page_size=32; expected .* <= min_prefill_bucket=16"):
        EngineConfig(**base, page_size=32)
    with pytest.raises(ValueError, match=r"engine.num_pages=8 gives 7 pages of page_size=8 rows .* needs 8"):
        EngineConfig(**base, page_size=8, num_pages=8)
    with pytest.raises(ValueError, match="engine.num_pages=20 without engine.page_size"):
        EngineConfig(**base, num_pages=20)
    assert EngineConfig(**base, page_size=8).pool_pages == 4 * 8 + 1
    assert EngineConfig(**base, page_size=8).live_page_buckets == (1, 2, 4, 8)


def _group(prompt, n=4, max_new=16):
    return [
        Request(f"s{i}", "g", "p", tuple(prompt), 0, max_new, SamplingParams(temperature=1.0, seed=100 + i))
        for i in range(n)
    ]


def test_a_groups_samples_share_the_prompts_pages_and_equal_unshared_ones(paged_engine, warm_engine, tiny_params):
    prompt = [(7 * j + 1) % TINY.vocab_size for j in range(30)]  # 3 whole pages of 8 and 6 rows more
    reference, _ = _run(warm_engine, tiny_params, requests=_group(prompt))  # dense: every sample prefilled whole
    counts = paged_engine.compile_counts()
    worker = RolloutWorker(paged_engine, eos_ids=())
    worker.load_version(0, tiny_params)
    for request in _group(prompt):
        worker.submit(request)
    worker.step()  # all four admitted in one step: the first prefills 30 tokens, the others 6 each
    pool = paged_engine.pages
    slots = [r.slot for r in worker._slots if r is not None]
    tables = [list(pool.pages(s)) for s in slots]
    assert all(table[:3] == tables[0][:3] for table in tables)  # the prompt's whole pages, held once
    assert len({table[3] for table in tables}) == 4  # the page they diverge in: each its own
    assert pool.capacity_pages - pool.free_pages == 3 + 4  # 3 shared + each its tail page (rows 24..31), not 4 x 4
    assert worker.counters.shared_prompt_tokens == 3 * 24 and worker.counters.prefill_tokens == 30 + 3 * 6
    done = run_to_end(worker)
    _assert_same(done, reference)
    assert pool.free_pages == pool.capacity_pages
    assert paged_engine.compile_counts() == counts  # the short prefills after shared pages were warm


def test_migrating_a_sample_that_shares_pages_keeps_its_tokens(paged_engine, paged_engine_b, tiny_params):
    prompt = [(5 * j + 2) % TINY.vocab_size for j in range(20)]
    reference, _ = _run(paged_engine, tiny_params, requests=_group(prompt, max_new=24))
    source = RolloutWorker(paged_engine, eos_ids=())
    source.load_version(0, tiny_params)
    for request in _group(prompt, max_new=24):
        source.submit(request)
    for _ in range(5):
        source.step()
    states = source.export_requests(["s1", "s3"])  # two of the sharers leave; the pages stay for the others
    destination = RolloutWorker(paged_engine_b, eos_ids=())
    destination.load_version(0, tiny_params)
    destination.import_requests(states)
    done = run_to_end(source) | run_to_end(destination)
    _assert_same(done, reference)
    for engine in (paged_engine, paged_engine_b):
        assert engine.pages.free_pages == engine.pages.capacity_pages
