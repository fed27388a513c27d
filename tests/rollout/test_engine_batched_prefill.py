"""Batched prefill (`RolloutEngine.prefill_insert`) equals one prefill and insert per request: the
same first tokens, log-probs within 1e-5 and the same decode afterwards, for the dense and the paged
cache and a MoE model, across buckets and counts that are not powers of two; no program compiles
after warm-up; the worker takes the batched path when several requests wait."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dora_jax.core.records import Request, SamplingParams
from dora_jax.models import init_model, split
from dora_jax.rollout.engine import EngineConfig, PrefillRequest, RolloutEngine
from dora_jax.rollout.pages import OutOfPages
from dora_jax.rollout.worker import RolloutWorker
from tests.rollout.conftest import TINY, run_to_end

# 8 slots; buckets 16, 32, 64; batched programs (2, 16), (4, 16), (2, 32): 64 tokens at most.
BATCHED = EngineConfig(num_slots=8, cache_length=96, max_prefill_length=64, min_prefill_bucket=16)
MOE = TINY.replace(model_type="qwen3_moe", qk_norm=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
LENGTHS = (3, 17, 5, 16, 30, 1, 9)  # 7 prompts: (4, 16) of 1..9 tokens, (2, 32) of 16 and 17, 30 alone
SAMPLINGS = (
    SamplingParams(temperature=1.0, seed=11),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=12),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.3, top_k=5, seed=13),
)
STEPS = 6


def _prompt(i: int, length: int) -> np.ndarray:
    return np.asarray([(7 * i + 3 * j + 1) % TINY.vocab_size for j in range(length)], np.int32)


def _requests(lengths=LENGTHS) -> list[PrefillRequest]:
    return [
        PrefillRequest(slot=7 - i, tokens=_prompt(i, n), sampling=SAMPLINGS[i % len(SAMPLINGS)])
        for i, n in enumerate(lengths)
    ]


def _engine(slices, model_config, config, seed=3):
    """An engine and its params; not warmed up (each test compiles what it runs: the cost here)."""
    engine = RolloutEngine(model_config, config, slices.rollout[0])
    return engine, engine.load_params(split(init_model(model_config, seed=seed))[1])


@pytest.fixture(scope="module")
def dense(slices):
    return _engine(slices, TINY, BATCHED)


@pytest.fixture(scope="module")
def paged(slices):
    return _engine(slices, TINY, dataclasses.replace(BATCHED, page_size=8))


def _decode(engine, params, state, slots) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and log-probs of `slots` over STEPS decode steps: [STEPS, len(slots)]."""
    tokens, logps = [], []
    for _ in range(STEPS):
        state, result = engine.generate(params, state)
        host = result.convert_to_numpy()
        tokens.append(host.data[slots, 0])
        logps.append(host.log_prob[slots, 0])
    return np.asarray(tokens), np.asarray(logps)


def _one_at_a_time(engine, params, requests):
    """Each request's prefill and insert in turn (a sharer as the worker admits it: the donor's
    whole pages, the rest prefilled after them); first (token, log-prob) per request, then decode."""
    state, first = engine.init_decode_state(), []
    for r in requests:
        tokens, prefix = np.asarray(r.tokens, np.int32), None
        if r.shared_from is not None:
            prefix = engine.shared_prefix(state, r.shared_from, len(tokens))
        begin = 0 if prefix is None else int(prefix.length)
        prefix, result = engine.prefill(
            params=params,
            existing_prefix=prefix,
            padded_tokens=tokens[begin:],
            true_length=len(tokens) - begin,
            sampling=r.sampling,
            sample_first=r.sample_first,
        )
        state = engine.insert(prefix, state, r.slot, shared_from=r.shared_from)
        host = result.convert_to_numpy()
        first.append((int(host.data[0, 0]), float(host.log_prob[0, 0])))
    tables = None if engine.pages is None else [list(engine.pages.pages(r.slot)) for r in requests]
    return first, tables, _decode(engine, params, state, [r.slot for r in requests])


def _batched(engine, params, requests):
    state = engine.init_decode_state()
    state, programs = engine.prefill_insert(params, state, requests)
    first = [None] * len(requests)
    for result, members in programs:
        host = result.convert_to_numpy()
        for row, i in enumerate(members):
            first[i] = (int(host.data[row, 0]), float(host.log_prob[row, 0]))
    tables = None if engine.pages is None else [list(engine.pages.pages(r.slot)) for r in requests]
    return first, tables, programs, _decode(engine, params, state, [r.slot for r in requests])


def _assert_batched_equals_one_at_a_time(engine, params, requests):
    first, tables, (tokens, logps) = _one_at_a_time(engine, params, requests)
    b_first, b_tables, programs, (b_tokens, b_logps) = _batched(engine, params, requests)
    assert [t for t, _ in b_first] == [t for t, _ in first]
    np.testing.assert_allclose([lp for _, lp in b_first], [lp for _, lp in first], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(b_tokens, tokens)
    np.testing.assert_allclose(b_logps, logps, atol=1e-5, rtol=0)
    assert b_tables == tables  # the same pages, shared ones included
    return programs


def test_the_batched_programs_of_an_engine_config():
    assert BATCHED.prefill_batches == ((2, 16), (4, 16), (2, 32))
    wide = dataclasses.replace(BATCHED, num_slots=6, max_prefill_length=128, cache_length=128)
    assert wide.prefill_batches == ((2, 16), (4, 16), (8, 16), (2, 32), (4, 32), (2, 64))  # 6 slots: up to 8 rows
    assert dataclasses.replace(BATCHED, max_prefill_batch=1).prefill_batches == ()
    with pytest.raises(ValueError, match="engine.max_prefill_batch=3; expected a power of two"):
        dataclasses.replace(BATCHED, max_prefill_batch=3)


@pytest.mark.slow
def test_batched_prefill_equals_one_at_a_time_dense(dense):
    programs = _assert_batched_equals_one_at_a_time(*dense, _requests())
    # the shortest first: four prompts of 1..9 tokens in (4, 16), 16 and 17 in (2, 32), 30 alone
    assert [(len(members), result.data.shape[0]) for result, members in programs] == [(4, 4), (2, 2), (1, 1)]
    assert [sorted(LENGTHS[i] for i in members) for _, members in programs] == [[1, 3, 5, 9], [16, 17], [30]]


def test_batched_prefill_pads_a_count_that_is_not_a_power_of_two(dense):
    programs = _assert_batched_equals_one_at_a_time(*dense, _requests((4, 12, 7)))
    assert [(len(members), result.data.shape[0]) for result, members in programs] == [(3, 4)]


@pytest.mark.slow
def test_batched_prefill_equals_one_at_a_time_paged_with_shared_pages(paged):
    engine, params = paged
    group = _prompt(9, 20)  # 2 whole pages of 8 below its end, shared by its later samples
    requests = _requests((3, 17, 5))
    requests += [
        PrefillRequest(slot=s, tokens=group, sampling=SamplingParams(temperature=1.0, seed=40 + s), shared_from=donor)
        for s, donor in ((2, None), (1, 2), (0, 2))
    ]
    requests.append(PrefillRequest(slot=3, tokens=_prompt(5, 9), sample_first=False))  # a resumed response
    _assert_batched_equals_one_at_a_time(engine, params, requests)
    pool = engine.pages
    assert list(pool.pages(1))[:2] == list(pool.pages(2))[:2] == list(pool.pages(0))[:2]
    # after the decode steps each holds its rows, its pending one's and STEPS more; the sharers 2 pages less
    rows = [len(r.tokens) - (not r.sample_first) + 1 + STEPS for r in requests]
    assert pool.capacity_pages - pool.free_pages == sum(pool.pages_for(n) for n in rows) - 2 * 2


@pytest.mark.slow
def test_batched_prefill_of_a_moe_model_equals_one_at_a_time(slices):
    _assert_batched_equals_one_at_a_time(*_engine(slices, MOE, BATCHED), _requests())


def test_no_recompiles_for_a_repeated_bucket(dense):
    engine, params = dense
    batches = ((5, 6), (9, 10, 11, 12), (20, 31), (1, 2, 3))  # (2, 16), (4, 16), (2, 32), (4, 16) padded
    state = engine.init_decode_state()
    for lengths in batches:  # compiles what this engine has not run yet
        state, _ = engine.prefill_insert(params, state, _requests(lengths))
    counts = engine.compile_counts()
    assert counts["prefill_insert"] == 3
    for lengths in batches[::-1]:
        state, _ = engine.prefill_insert(params, state, _requests(lengths))
    assert engine.compile_counts() == counts


@pytest.mark.slow
def test_warmup_compiles_every_batched_program(paged):
    engine, params = paged
    engine.warmup(params, migration=False)
    counts = engine.compile_counts()
    assert counts["prefill_insert"] >= len(BATCHED.prefill_batches)
    state = engine.init_decode_state()
    for lengths in ((5, 6), (9, 10, 11, 12), (20, 31), (1, 2, 3)):  # every (C, T)
        state, _ = engine.prefill_insert(params, state, _requests(lengths))
    assert engine.compile_counts() == counts
    assert {name for name, _ in engine.lower_programs()} >= {"prefill_insert[C=2,T=16]", "prefill_insert[C=2,T=32]"}


def test_batched_prefill_refuses_bad_requests_naming_them(dense, paged):
    engine, params = dense
    state = engine.init_decode_state()
    with pytest.raises(ValueError, match="slots \\[7, 7\\]: expected each slot once"):
        engine.prefill_insert(params, state, [PrefillRequest(7, [1]), PrefillRequest(7, [2])])
    with pytest.raises(ValueError, match="a batched prefill of 65 tokens; expected 1..max_prefill_length=64"):
        engine.prefill_insert(params, state, [PrefillRequest(0, [1] * 65)])
    with pytest.raises(ValueError, match="tokens holds token id 96 outside the vocabulary"):
        engine.prefill_insert(params, state, [PrefillRequest(0, [1, 96])])
    small = RolloutEngine(TINY, dataclasses.replace(BATCHED, page_size=8, num_pages=14), engine.mesh)
    small_state = small.init_decode_state()
    too_many = [PrefillRequest(s, _prompt(s, 30)) for s in range(4)]  # 4 pages each, 13 in the pool
    with pytest.raises(OutOfPages, match="4 prefills need 16 pages; 13 are free"):
        small.prefill_insert(params, small_state, too_many)
    assert small.pages.free_pages == 13  # nothing taken


def _worker_requests(n=7):
    return [
        Request(f"t{i}", "g", f"p{i}", tuple(int(t) for t in _prompt(i, LENGTHS[i % 7])), 0, 10, SAMPLINGS[i % 4])
        for i in range(n)
    ]


@pytest.mark.parametrize("fixture", ["dense", "paged"])
def test_the_worker_batches_waiting_requests_with_unchanged_results(fixture, request):
    engine, params = request.getfixturevalue(fixture)
    runs = {}
    for batched in (False, True):
        worker = RolloutWorker(engine, eos_ids=(), batched_prefill=batched)
        worker.load_version(0, params)
        for r in _worker_requests():
            worker.submit(r)
        runs[batched] = (run_to_end(worker), worker.counters)
    (one, one_counters), (batched, counters) = runs[False], runs[True]
    assert one.keys() == batched.keys()
    for traj_id, ref in one.items():
        assert batched[traj_id].response_ids == ref.response_ids, traj_id
        np.testing.assert_allclose(batched[traj_id].logprobs, ref.logprobs, atol=1e-5, rtol=0)
    assert one_counters.prefill_batches == 0 and counters.prefill_batches == 2  # (4, 16) and (2, 32); 30 alone
    assert counters.prefills == one_counters.prefills == 7
    assert counters.prefill_tokens == one_counters.prefill_tokens == sum(LENGTHS)
