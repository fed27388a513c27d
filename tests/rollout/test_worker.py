"""Worker: versions_seen from the params used, continuous batching, rejections, re-dispatch, and the
pipelined loop (one decode step in flight between calls) equal to the unpipelined one."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from dora_jax.core.records import FinishReason, Request, SamplingParams
from dora_jax.rollout.engine import RolloutEngine
from dora_jax.rollout.worker import RolloutWorker, as_redispatch, export_from, import_into
from dora_jax.runtime.run_config import RolloutSpec
from tests.rollout.conftest import ENGINE, TINY, run_to_end

GREEDY = SamplingParams(temperature=0.0)


def _request(traj_id, prompt=(1, 4, 9, 16), max_new=12, sampling=GREEDY, **kw):
    return Request(traj_id, "g", "p", tuple(prompt), 0, max_new, sampling, **kw)


@pytest.fixture(scope="module")
def other_params(tiny_params):
    return jax.tree.map(lambda x: x * 1.5, tiny_params)


def test_versions_seen_come_from_the_params_used(warm_engine, tiny_params, other_params):
    worker = RolloutWorker(warm_engine, eos_ids=())
    worker.load_version(3, tiny_params)
    worker.submit(_request("a", max_new=10))
    for _ in range(4):
        worker.step()
    with pytest.raises(RuntimeError, match="1 requests are active on version 3"):
        worker.load_version(4, other_params)
    worker.load_version(4, other_params, allow_active=True)  # partial-rollout style swap
    traj = run_to_end(worker)["a"]
    assert traj.version == 0  # as dispatched
    assert traj.versions_seen == (3, 4)  # as generated
    assert len(traj.response_ids) == 10


def test_slots_are_refilled_while_the_queue_is_not_empty(warm_engine, tiny_params):
    worker = RolloutWorker(warm_engine, eos_ids=())
    worker.load_version(0, tiny_params)
    lengths = [30, 2, 3, 2, 5, 2, 3, 2, 4, 2, 3, 2, 6, 2]  # long-tailed
    for i, n in enumerate(lengths):
        worker.submit(_request(f"r{i}", max_new=40, forced_length=n, sampling=SamplingParams(seed=i)))
    done = {}
    while worker.has_work:
        queued_before = worker.num_queued
        idle_before = worker.counters.idle_slot_steps
        done.update({t.traj_id: t for t in worker.step()})
        if queued_before:
            assert worker.counters.idle_slot_steps == idle_before, "a slot sat idle while requests waited"
    assert {t: len(done[t].response_ids) for t in done} == {f"r{i}": n for i, n in enumerate(lengths)}
    assert all(t.finish_reason == FinishReason.FORCED for t in done.values())
    counters = worker.counters
    assert counters.prefills == len(lengths) and counters.finished == len(lengths)
    assert counters.decode_steps == 29  # the long one (30 tokens: 1 from prefill + 29 decode steps)
    assert counters.slot_steps == 29 * worker.num_slots
    assert 0 < counters.bubble_ratio < 1 and counters.occupancy == pytest.approx(1 - counters.bubble_ratio)


def test_bad_requests_are_rejected_and_the_loop_goes_on(warm_engine, tiny_params):
    worker = RolloutWorker(warm_engine, eos_ids=())
    worker.load_version(0, tiny_params)
    bad = {
        "cache": (_request("cache", max_new=61), "max_new_tokens=61 with 4 prompt tokens exceeds cache_length=64"),
        "vocab": (_request("vocab", prompt=(1, 96)), "prompt_ids holds token id 96"),
        "temp": (_request("temp", sampling=SamplingParams(temperature=-1.0)), "sampling.temperature=-1.0"),
        "forced": (_request("forced", forced_length=13), "forced_length=13"),
        "prefix": (_request("prefix", prefix_response_ids=(3, 4)), "prefix_response_ids has 2 tokens"),
        "empty": (_request("empty", prompt=()), "prompt_ids is empty"),
    }
    worker.submit(_request("good", max_new=5))
    worker.submit(_request("long", prompt=range(1, 41), max_new=5))  # 40 > max_prefill_length=32: two chunks
    for request, _ in bad.values():
        worker.submit(request)
    assert worker.num_queued == 2
    done = run_to_end(worker)
    for good in ("good", "long"):
        assert done[good].finish_reason == FinishReason.LENGTH and len(done[good].response_ids) == 5
    for traj_id, (_, message) in bad.items():
        assert done[traj_id].finish_reason == FinishReason.REJECTED
        assert message in done[traj_id].error, done[traj_id].error
    assert worker.counters.rejected == len(bad)
    with pytest.raises(ValueError, match="already on worker"):
        worker.submit(_request("x"))
        worker.submit(_request("x"))


def test_stop_ids_eos_and_forced_length(warm_engine, tiny_params):
    worker = RolloutWorker(warm_engine, eos_ids=())
    worker.load_version(0, tiny_params)
    worker.submit(_request("ref", max_new=16))
    ref = run_to_end(worker)["ref"].response_ids
    stop = ref[5]
    eos_worker = RolloutWorker(warm_engine, eos_ids=(stop,))
    eos_worker.load_version(0, tiny_params)
    eos_worker.submit(_request("eos", max_new=16))
    eos_worker.submit(_request("stop", max_new=16, stop_ids=(stop,)))
    eos_worker.submit(_request("forced", max_new=16, forced_length=9))
    done = run_to_end(eos_worker)
    first = ref.index(stop)
    assert done["eos"].response_ids == ref[: first + 1] and done["eos"].finish_reason == FinishReason.EOS
    assert done["stop"].response_ids == ref[: first + 1] and done["stop"].finish_reason in (
        FinishReason.EOS,
        FinishReason.STOP,
    )
    assert done["forced"].response_ids == ref[:9] and done["forced"].finish_reason == FinishReason.FORCED


@pytest.mark.parametrize("pipelined", [True, False])
@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0, seed=5)])
@pytest.mark.parametrize("steps", [8, 30])  # re-prefill on prompt + 9 tokens; on 4 + 31 > max_prefill_length, in chunks
def test_redispatch_with_prefix_continues_the_same_sequence(warm_engine, tiny_params, sampling, steps, pipelined):
    worker = RolloutWorker(warm_engine, eos_ids=(), pipelined=pipelined)
    worker.load_version(0, tiny_params)
    worker.submit(_request("a", max_new=40, sampling=sampling))
    for _ in range(steps):
        worker.step()
    (state,) = worker.export_requests()
    held = steps + 1 - pipelined  # the first token + one per step read (pipelined: the last is in flight)
    assert len(state.response_ids) == held
    worker.submit(as_redispatch(state))  # on the same version
    resumed = run_to_end(worker)["a"]
    worker.submit(_request("b", max_new=40, sampling=sampling))
    straight = run_to_end(worker)["b"]
    assert resumed.response_ids == straight.response_ids
    assert resumed.logprobs[:held] == straight.logprobs[:held]  # the prefix keeps its own log-probs
    assert max(abs(a - b) for a, b in zip(resumed.logprobs, straight.logprobs)) < 1e-5
    assert worker.counters.prefills == 3 and worker.counters.prefill_tokens == 4 + (4 + held) + 4


def test_prefix_tokens_keep_their_versions_and_queue_can_be_taken(warm_engine, tiny_params):
    worker = RolloutWorker(warm_engine, eos_ids=())
    worker.load_version(8, tiny_params)
    worker.submit(
        _request("p", max_new=6, prefix_response_ids=(5, 6), prefix_logprobs=(-1.0, -2.0), prefix_versions=(6, 7))
    )
    for i in range(6):
        worker.submit(_request(f"q{i}"))
    worker.step()
    assert worker.num_active == 4 and worker.num_queued == 3
    taken = worker.take_queued(["q5", "q4"])
    assert [r.traj_id for r in taken] == ["q4", "q5"] and worker.queued_traj_ids == ("q3",)
    with pytest.raises(ValueError, match="no in-flight request"):
        worker.export_requests(["q3"])
    traj = run_to_end(worker)["p"]
    assert traj.response_ids[:2] == (5, 6) and traj.logprobs[:2] == (-1.0, -2.0)
    assert traj.versions_seen == (6, 7, 8) and len(traj.response_ids) == 6
    assert dataclasses.replace(traj).prompt_ids == (1, 4, 9, 16)


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0, seed=5)])
def test_progress_is_a_resumable_snapshot_that_leaves_the_worker_untouched(warm_engine, tiny_params, sampling):
    """What a checkpoint keeps of in-flight work: resumed in a new worker, the same sequence."""
    worker = RolloutWorker(warm_engine, eos_ids=())
    worker.load_version(0, tiny_params)
    for name in "abcde":  # 4 slots: one stays queued
        worker.submit(_request(name, max_new=16, sampling=sampling))
    for _ in range(6):
        worker.step()
    snapshot = worker.progress()
    assert set(snapshot) == set("abcde") and worker.num_active == 4 and worker.num_queued == 1
    assert snapshot["e"].prefix_response_ids == ()  # queued: nothing generated yet
    active = [t for t in "abcd" if snapshot[t].prefix_response_ids]
    assert active and all(len(snapshot[t].prefix_response_ids) == len(snapshot[t].prefix_versions) for t in active)
    straight = run_to_end(worker)  # the snapshot did not disturb the original
    fresh = RolloutWorker(warm_engine, eos_ids=())
    fresh.load_version(0, tiny_params)
    for request in snapshot.values():
        fresh.submit(request)
    resumed = run_to_end(fresh)
    for name in "abcde":
        assert resumed[name].response_ids == straight[name].response_ids


def test_an_engine_without_sampling_filters_compiles_no_sort_and_samples_the_same(slices, tiny_params):
    """`EngineConfig.sampling_filters=False` (a run that samples with top_k=0 and top_p=1): prefill
    and generate carry no sort over the vocabulary (costly to compile on TPU), unfiltered requests
    draw exactly the tokens of a filtering engine, and a filtered request is refused by name."""
    plain = RolloutEngine(TINY, dataclasses.replace(ENGINE, sampling_filters=False), slices.rollout[1])
    filtering = RolloutEngine(TINY, ENGINE, slices.rollout[1])
    programs = {name: lowered.as_text() for name, lowered in plain.lower_programs()}
    with_filter = dict(filtering.lower_programs())
    for name in ("generate", "prefill[T=16]"):
        assert "stablehlo.sort" not in programs[name] and "stablehlo.sort" in with_filter[name].as_text(), name
    hot = SamplingParams(temperature=1.0, seed=7)
    runs = {}
    for label, engine in (("plain", plain), ("filtering", filtering)):
        worker = RolloutWorker(engine, eos_ids=())
        worker.load_version(0, tiny_params)
        for i in range(3):
            sampling = dataclasses.replace(hot, seed=i)
            worker.submit(_request(f"r{i}", prompt=(1, 5 + i, 9), max_new=12, sampling=sampling))
        if label == "plain":
            worker.submit(_request("topk", sampling=dataclasses.replace(hot, top_k=5)))
            # greedy rows never filter: accepted
            worker.submit(_request("greedy_topk", sampling=SamplingParams(temperature=0.0, top_k=5)))
        runs[label] = run_to_end(worker)
    for i in range(3):
        a, b = runs["plain"][f"r{i}"], runs["filtering"][f"r{i}"]
        assert a.response_ids == b.response_ids and np.allclose(a.logprobs, b.logprobs, atol=1e-6)
    assert runs["plain"]["topk"].finish_reason == FinishReason.REJECTED
    assert "sampling.top_k=5" in runs["plain"]["topk"].error and "sampling_filters" in runs["plain"]["topk"].error
    assert runs["plain"]["greedy_topk"].finish_reason == FinishReason.LENGTH
    spec = lambda **s: RolloutSpec(1, 4, 64, 32, SamplingParams(**s), 8)  # noqa: E731
    assert not spec().engine_config().sampling_filters
    assert spec(top_k=20).engine_config().sampling_filters and spec(top_p=0.9).engine_config().sampling_filters


EOS, STOP = 91, 57  # tokens the mixed run below draws mid-response (checked: every finish reason occurs)


def _mixed_run(engine, params, *, pipelined: bool) -> tuple[dict, RolloutWorker]:
    """Mixed lengths, greedy and filtered sampling, a chunked prompt, a re-dispatch prefix, a
    request that ends on its first token, EOS and stop ids, admissions mid-run (more requests than
    slots), and two requests migrated out and back in mid-run; {traj_id: Trajectory}."""
    hot = lambda seed, **kw: SamplingParams(temperature=1.0, seed=seed, **kw)  # noqa: E731
    prefix = {"prefix_response_ids": (11, 12), "prefix_logprobs": (-1.0, -2.0), "prefix_versions": (0, 0)}
    schedule = {
        0: [
            _request("greedy", max_new=30),
            _request("stop", prompt=range(3, 10), max_new=24, sampling=hot(1), stop_ids=(STOP,)),
            _request("forced", prompt=(5, 6, 7), max_new=20, sampling=hot(2), forced_length=7),
            _request("chunked", prompt=range(1, 41), max_new=10, sampling=SamplingParams(0.8, top_k=10, seed=3)),
            _request("one", prompt=(2, 3), max_new=1),
            _request("prefix", prompt=(8, 9, 10), max_new=16, sampling=hot(4, top_p=0.9), **prefix),
        ],
        4: [_request(f"mid{i}", prompt=(i, 2 * i, 7), max_new=6 + 5 * i, sampling=hot(10 + i)) for i in range(1, 5)],
        12: [_request("late", prompt=(4, 4), max_new=9, sampling=hot(20), forced_length=3), _request("last")],
    }
    worker = RolloutWorker(engine, eos_ids=(EOS,), pipelined=pipelined)
    worker.load_version(0, params)
    done = {}
    for call in range(200):
        for request in schedule.pop(call, []):
            worker.submit(request)
        if call == 6:  # "forced" holds 6 tokens and has its 7th and last in flight when pipelined
            import_into(worker, export_from(worker, ["forced", "greedy", "mid1"])[::-1])
        if not worker.has_work and not schedule:
            return done, worker
        done.update({t.traj_id: t for t in worker.step()})
    raise AssertionError("the mixed run did not finish in 200 steps")


def test_pipelined_worker_equals_unpipelined(warm_engine, tiny_params):
    """Dispatching step N + 1 before reading step N changes when the host learns things (a slot
    freed by EOS is refilled a step later, exports drop the step in flight), never what a request
    generates: tokens, log-probs, finish reasons and versions are those of the unpipelined loop."""
    params = warm_engine.load_params(tiny_params)
    compiled = warm_engine.compile_counts()
    straight, plain = _mixed_run(warm_engine, params, pipelined=False)
    piped, pipelined = _mixed_run(warm_engine, params, pipelined=True)
    assert warm_engine.compile_counts() == compiled  # nothing compiles after warm-up
    assert set(piped) == set(straight) and len(straight) == 12
    reasons = {t.finish_reason for t in straight.values()}
    assert reasons == {FinishReason.EOS, FinishReason.STOP, FinishReason.LENGTH, FinishReason.FORCED}, reasons
    for traj_id, ref in straight.items():
        got = piped[traj_id]
        assert got.response_ids == ref.response_ids, traj_id
        assert np.allclose(got.logprobs, ref.logprobs, rtol=0, atol=1e-6), traj_id
        assert (got.finish_reason, got.versions_seen) == (ref.finish_reason, ref.versions_seen), traj_id
    assert len(straight["one"].response_ids) == 1 and straight["prefix"].response_ids[:2] == (11, 12)
    a, b = plain.counters, pipelined.counters
    assert (a.prefills, a.generated_tokens, a.finished) == (b.prefills, b.generated_tokens, b.finished)
    # pipelined: a slot that ends by EOS or stop (or leaves) computes one more, discarded token
    assert b.decode_steps >= a.decode_steps and b.idle_slot_steps > a.idle_slot_steps
