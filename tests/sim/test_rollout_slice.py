"""The simulated slice behind the coordinator's port: exact finish times, stalls, migration with and
without its KV cache, partial-rollout re-prefill, weight loads, lending to a colocated trainer."""

import collections
import dataclasses
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dora_jax.core.records import FinishReason, Request, SlotState
from dora_jax.sim.rollout_slice import Repeated, SimSlice, _count_sorted, _expand, _Queue, _Run
from tests.sim.helpers import tiny_cluster


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make_slices(n=1, kv_migration=True, **kwargs):
    clock, changed = Clock(), []
    cluster = tiny_cluster(groups=n, **kwargs)
    slices = [
        SimSlice(
            i,
            cluster,
            prompt_tokens=8,
            samples_per_prompt=2,
            chunk_tokens=1e-6,
            clock=clock,
            on_change=changed.append,
            kv_migration=kv_migration,
        )
        for i in range(n)
    ]
    for s in slices:
        s.load_version(0)
    return clock, slices


def request(traj, length, version=0):
    return Request(traj, traj.split("/")[0], "p", (), version, max_new_tokens=1000, forced_length=length)


def _run(traj):
    return _Run(request(traj, 5), 5, 0, {}, 0.0, 0.0)


def drain(clock, slices):
    """Runs every slice's finish events in time order; returns {traj: (finish time, trajectory)}."""
    done = {}
    while True:
        pending = [(s.next_finish(), s.slice_id) for s in slices if s.next_finish() is not None]
        if not pending:
            return done
        t, sid = min(pending)
        clock.now = t
        for traj in slices[sid].finish(t):
            done[traj.traj_id] = (t, traj)


def test_finish_times_follow_t_of_a():
    # t(a) = 1 + 0.5 a: both decode at t(2) = 2 s/token; after 10 tokens the first finishes and
    # the second runs its last 10 tokens at t(1) = 1.5 s/token.
    clock, [s] = make_slices(t0=1.0, t1=0.5)
    s.submit([request("g0/0", 10), request("g0/1", 20)])
    done = drain(clock, [s])
    assert {k: t for k, (t, _) in done.items()} == pytest.approx({"g0/0": 20.0, "g0/1": 35.0})
    assert s.costs.busy_slot_s == pytest.approx(20.0 * 2 + 15.0)
    traj = done["g0/1"][1]
    assert traj.num_tokens == 20 and traj.versions_seen == (0,) and traj.finish_reason == FinishReason.FORCED


def test_prefill_stalls_the_slice_and_queued_requests_wait_for_a_slot():
    clock, [s] = make_slices(slots=1, prefill=0.25)  # prompt share 8 / 2 = 4 tokens -> 1 s each
    s.submit([request("g0/0", 3), request("g0/1", 3)])
    done = drain(clock, [s])
    assert done["g0/0"][0] == pytest.approx(4.0)  # 1 s prefill + 3 tokens
    assert done["g0/1"][0] == pytest.approx(8.0)  # admitted at 4 s: 1 s prefill + 3 tokens
    assert s.costs.prefill_tokens == pytest.approx(8.0)


def test_migration_with_kv_keeps_progress_and_pays_only_the_transfer():
    clock, (src, dst) = make_slices(2, kv_bytes=1e8)  # (8 prompt + 4 generated) x 1e8 B / 1e9 B/s = 1.2 s
    src.submit([request("g0/0", 10), request("g0/1", 10)])
    clock.now = 4.0
    [state] = src.export(["g0/0"])
    assert isinstance(state, SlotState) and len(state.response_ids) == 4 and state.token_versions == (0,) * 4
    dst.import_([state])
    done = drain(clock, [src, dst])
    assert done["g0/1"][0] == pytest.approx(10.0)
    assert done["g0/0"][0] == pytest.approx(4.0 + 1.2 + 6.0)  # 6 tokens left, no re-prefill
    assert dst.costs.prefill_tokens == 0.0 and dst.costs.migration_s == pytest.approx(1.2)
    assert done["g0/0"][1].num_tokens == 10 and done["g0/0"][1].slice_id == 1


def test_migration_without_kv_re_prefills_prompt_share_and_generated_tokens():
    clock, (src, dst) = make_slices(2, kv_migration=False, prefill=0.1)
    src.submit([request("g0/0", 10)])  # 0.4 s prefill
    clock.now = 3.4  # 3 tokens generated
    dst.import_(src.export(["g0/0"]))
    assert dst.costs.prefill_tokens == pytest.approx(4 + 3)
    assert drain(clock, [src, dst])["g0/0"][0] == pytest.approx(3.4 + 0.7 + 7.0)


def test_queued_requests_export_as_requests():
    clock, [s] = make_slices(slots=1)
    s.submit([request("g0/0", 5), request("g0/1", 5)])
    out = s.export(["g0/1", "gone/0"])
    assert [type(x) for x in out] == [Request] and out[0].traj_id == "g0/1"


def test_interrupt_re_prefills_and_records_every_version_that_sampled():
    # The coordinator's partial-rollout path: export, load the new version, import as Requests.
    clock, [s] = make_slices(prefill=0.1)
    s.submit([request("g0/0", 10)])  # 0.4 s prefill
    clock.now = 3.4  # 3 tokens at version 0
    [state] = s.export(["g0/0"])
    s.load_version(1)
    s.import_(
        [
            dataclasses.replace(
                state.request,
                prefix_response_ids=state.response_ids,
                prefix_logprobs=state.logprobs,
                prefix_versions=state.token_versions,
            )
        ]
    )
    assert s.costs.prefill_tokens == pytest.approx(4 + 4 + 3)  # prompt share twice, 3 generated tokens once
    ((t, traj),) = drain(clock, [s]).values()
    assert t == pytest.approx(3.4 + 0.7 + 7.0)
    assert traj.versions_seen == (0, 1) and traj.version == 0 and traj.num_tokens == 10


def test_load_version_needs_an_empty_slice_and_stalls_it():
    clock, [s] = make_slices(weight_load=2.0)
    s.load_version(1)
    assert s.version == 1 and s.costs.weight_loads == 2  # the initial load and this one
    s.submit([request("g0/0", 1, version=1)])
    assert drain(clock, [s])["g0/0"][0] == pytest.approx(4.0 + 1.0)  # two loads, then one token
    s.submit([request("g1/0", 1, version=1)])
    with pytest.raises(RuntimeError, match="load_version with requests"):
        s.load_version(2)


def test_lending_to_a_colocated_trainer_pauses_decoding_and_is_not_busy_time():
    clock, [s] = make_slices()
    s.submit([request("g0/0", 4)])
    clock.now = 2.0
    s.lend(2.0, 10.0)
    ((t, _),) = drain(clock, [s]).values()
    assert t == pytest.approx(14.0)
    assert s.costs.busy_slot_s == pytest.approx(4.0)


def test_progress_reports_tokens_so_far_without_touching_the_slice():
    clock, [s] = make_slices(slots=1)
    s.submit([request("g0/0", 10), request("g0/1", 10)])
    clock.now = 6.0
    progress = s.progress()
    assert len(progress["g0/0"].prefix_response_ids) == 6 and progress["g0/1"].prefix_response_ids == ()
    assert s.active == 1 and drain(clock, [s])["g0/0"][0] == pytest.approx(10.0)


def test_repeated_is_a_constant_sequence():
    r = Repeated(0, 5)
    assert len(r) == 5 and list(r) == [0] * 5 and tuple(r[1:3]) == (0, 0) and r[-1] == 0
    with pytest.raises(IndexError):
        r[5]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "first", "pop", "take"]), st.integers(0, 3)), max_size=40))
def test_the_queue_keeps_the_order_a_deque_would(ops):
    """_Queue (by id) against a deque scanned the way export used to: same runs, same order."""
    queue, reference, made = _Queue(), collections.deque(), itertools.count()

    def runs(n):
        return [_run(f"t{next(made)}") for _ in range(n)]

    for op, n in ops:
        if op == "append":
            for run in runs(1):
                queue.append(run)
                reference.append(run)
        elif op == "first":
            batch = runs(n)
            queue.put_first(batch)
            reference.extendleft(reversed(batch))
        elif op == "pop" and reference:
            assert queue.popleft() is reference.popleft()
        elif op == "take":
            wanted = [r.request.traj_id for r in list(reference)[::2][:n]] + ["absent"]
            assert queue.take(wanted) == [r for r in reference if r.request.traj_id in wanted]
            reference = collections.deque(r for r in reference if r.request.traj_id not in wanted)
        assert list(queue) == list(reference) and len(queue) == len(reference)


def test_count_sorted_inverts_expand():
    counts = {0: 3, 2: 1, 5: 4}
    assert _count_sorted(_expand(counts)) == counts
    assert _count_sorted(()) == {} and _count_sorted((7,)) == {7: 1}


@pytest.mark.parametrize("value, n", [(0, 3000), (7, 1), (-1, 5), (0.0, 2400), (-0.5, 10), (float("nan"), 4)])
def test_a_repeated_run_reduces_in_o1_as_the_builtins_do_and_the_intake_checks_it_the_same(value, n):
    """The coordinator's intake checks every finished trajectory's tokens and log-probs; the
    simulator's constant runs give it O(1) reductions (intake._reduce), with the builtins' answers
    and so the same verdicts as on a tuple."""
    from dora_jax.coordinator import intake
    from dora_jax.sim.rollout_slice import Repeated

    run, plain = Repeated(value, n), (value,) * n
    for name, builtin in (("min", min), ("max", max), ("sum", sum)):
        got, want = intake._reduce(run, name), builtin(plain)
        assert got == want or (math.isnan(got) and math.isnan(want)), name
    if isinstance(value, int):
        assert intake._tokens(run, 8) == intake._tokens(plain, 8)
    assert intake._logprobs(run) == intake._logprobs(plain)
