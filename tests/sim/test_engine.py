"""The rollout pool's lazy decode clocks: exact finish times, stalls, migration, interruption."""

import pytest

from dora_jax.sim.engine import EventQueue, RolloutPool
from dora_jax.sim.ledger import Ev, EventLog
from tests.sim.helpers import tiny_cluster


def make_pool(**kwargs):
    cluster = tiny_cluster(**kwargs)
    return RolloutPool(cluster, EventQueue(), EventLog(), prompt_tokens=8, samples_per_prompt=2,
                       chunk_tokens=1e-6)


def drain(pool):
    """Runs group events until none is left; returns {traj: finish time}."""
    finished = {}
    while len(pool.queue):
        t, _, gid, epoch = pool.queue.pop()
        g = pool.groups[gid]
        if g.epoch != epoch:
            continue
        for traj in pool.complete(g, t):
            finished[traj] = t
        pool.schedule(g)
    return finished


def test_finish_times_follow_t_of_a():
    # t(a) = 1 + 0.5 a: both decode at t(2) = 2 s/token; after 10 tokens the first finishes and
    # the second runs its last 10 tokens at t(1) = 1.5 s/token.
    pool = make_pool(groups=1, t0=1.0, t1=0.5)
    pool.dispatch_prompt([10, 20], version=0, now=0.0)
    pool.fill(pool.groups[0], 0.0)
    assert drain(pool) == pytest.approx({0: 20.0, 1: 35.0})
    assert pool.groups[0].busy_slot_s == pytest.approx(20.0 * 2 + 15.0)


def test_prefill_stalls_the_group():
    pool = make_pool(groups=1, prefill=0.25)  # prompt share 8 / 2 = 4 tokens -> 1 s per request
    pool.dispatch_prompt([3, 3], version=0, now=0.0)
    pool.fill(pool.groups[0], 0.0)
    assert drain(pool) == pytest.approx({0: 5.0, 1: 5.0})  # 2 s of prefill, then 3 tokens


def test_migration_keeps_progress_and_pays_only_the_transfer():
    pool = make_pool(groups=2, kv_bytes=1e8)  # context (8 + 4 tokens) x 1e8 B / 1e9 B/s = 1.2 s
    pool.dispatch_prompt([10, 10], version=0, now=0.0)
    src, dst = pool.groups
    pool.fill(src, 0.0)
    pool.settle(src, 4.0)
    prefilled = pool.prefill_tokens
    pool.migrate(0, src, dst, 4.0)
    pool.schedule(src)
    pool.schedule(dst)
    done = drain(pool)
    assert done[1] == pytest.approx(10.0)
    assert done[0] == pytest.approx(4.0 + 6.0 + 1.2)  # 6 tokens left, no re-prefill
    assert pool.prefill_tokens == prefilled and pool.migrations == 1
    assert any(e[0] == Ev.MIGRATE for e in pool.log.events)


def test_interrupt_requires_re_prefill_of_prompt_and_generated_tokens():
    pool = make_pool(groups=1, prefill=0.1)
    pool.dispatch_prompt([10, 10], version=0, now=0.0)
    g = pool.groups[0]
    pool.fill(g, 0.0)  # 2 x 4 prompt tokens = 0.8 s of prefill
    pool.interrupt(g, 0, 3.8)  # 3 tokens generated
    assert pool.remaining[0] == pytest.approx(7.0)
    assert pool.prefill_due[0] == pytest.approx(4 + 3)


def test_switch_needs_an_empty_group_and_stalls_it():
    pool = make_pool(groups=1, weight_load=2.0)
    g = pool.groups[0]
    pool.switch(g, 1, 0.0)
    assert g.version == 1 and g.stall_end == 2.0 and pool.weight_loads == 1
    pool.dispatch_prompt([1, 1], version=1, now=0.0)
    pool.fill(g, 0.0)
    with pytest.raises(AssertionError):
        pool.switch(g, 2, 0.5)
