"""Slice supervision with stand-in worker threads and a recording coordinator: who is reported,
abandoned, restarted and when (the real worker threads are exercised in tests/test_reliability.py)."""

from dora_jax.runtime.supervisor import SliceSupervisor


class _Thread:
    def __init__(self, sid):
        self.slice_id, self.error, self.last_beat, self.alive, self.abandoned = sid, None, 0.0, True, None

    def abandon(self, reason):
        self.abandoned = reason


class _Coordinator:
    def __init__(self):
        self.failed, self.joined, self.given_up = [], [], []

    def post_slice_failed(self, sid, reason):
        self.failed.append((sid, reason))

    def post_slice_joined(self, thread):
        self.joined.append(thread.slice_id)

    def post_slice_wont_rejoin(self, sid, reason):
        self.given_up.append((sid, reason))


def _supervisor(max_rejoins=1):
    now = [0.0]
    coord = _Coordinator()
    threads = {i: _Thread(i) for i in range(3)}
    sup = SliceSupervisor(
        coord,
        threads,
        _Thread,
        heartbeat_timeout_s=10.0,
        max_rejoins=max_rejoins,
        restart_delay_s=1.0,
        clock=lambda: now[0],
    )
    return sup, coord, threads, now


def test_crashed_hung_and_coordinator_dropped_slices_are_all_restarted():
    sup, coord, threads, now = _supervisor()
    old = dict(threads)
    threads[0].error = RuntimeError("boom")  # crashed
    now[0] = 11.0
    for t in (threads[0], threads[2]):
        t.last_beat = 10.5  # slice 1 has not beaten since 0.0: hung
    sup.check()
    assert coord.failed == [(0, "RuntimeError: boom"), (1, "TimeoutError: no heartbeat for 10s")]
    sup.check()
    assert len(coord.failed) == 2  # reported once
    for sid, why in [(0, "RuntimeError: boom"), (1, "missed heartbeats"), (2, "load_version failed: StoreError")]:
        sup.dropped(sid, why)  # the coordinator dropped them, slice 2 on its own finding
    sup.check()
    assert all(old[s].abandoned for s in range(3)) and "StoreError" in old[2].abandoned
    old[0].alive = old[2].alive = False  # their threads exited; slice 1 is still stuck in a step
    now[0] = 12.5
    sup.check()
    assert sorted(coord.joined) == [0, 2] and threads[0] is not old[0] and threads[1] is old[1]
    old[1].alive = False
    now[0] = 14.0
    sup.check()
    assert sorted(coord.joined) == [0, 1, 2] and sup.rejoins == {0: 1, 1: 1, 2: 1}
    assert len(sup.all_threads) == 6 and [s for s, _ in sup.drops] == [0, 1, 2]


def test_a_slice_past_max_rejoins_stays_down():
    sup, coord, threads, now = _supervisor(max_rejoins=1)
    for _ in range(2):
        thread = threads[0]
        sup.dropped(0, "port call timed out")
        sup.check()
        thread.alive = False
        now[0] += 2.0
        sup.check()
    assert coord.joined == [0] and sup.rejoins == {0: 1}
    assert len(sup.drops) == 2


def test_a_drop_says_whether_the_slice_comes_back_and_a_hung_one_is_given_up_on():
    """`dropped` promises a restart while rejoins are left (the coordinator then waits with every
    slice down); a slice whose hung thread holds its engine for 10 heartbeat timeouts is given up
    on: the coordinator is told it fails after all."""
    sup, coord, threads, now = _supervisor(max_rejoins=1)
    assert sup.dropped(0, "hung") is True
    sup.check()
    for t in (0.0, 50.0, 99.0):  # the restart waits for the thread
        now[0] = 1.0 + t
        threads[1].last_beat = threads[2].last_beat = now[0]
        sup.check()
        assert coord.joined == [] and coord.given_up == []
    now[0] = 1.0 + 101.0
    sup.check()
    assert coord.joined == [] and coord.given_up == [(0, "not restarted: its hung thread held the engine for 101s")]
    threads[1].alive = False
    assert sup.dropped(1, "crashed") is True
    sup.check()
    now[0] += 1.0
    sup.check()
    assert coord.joined == [1] and sup.dropped(1, "crashed again") is False  # its one rejoin is spent
