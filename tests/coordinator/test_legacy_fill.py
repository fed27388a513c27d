"""Legacy fill: the pure rule (deadline, window) and the coordinator using it on scripted slices."""

import collections

import pytest

from dora_jax.coordinator import legacy_fill
from dora_jax.coordinator.audit import audit
from dora_jax.coordinator.coordinator import Coordinator, CoordinatorConfig
from dora_jax.coordinator.ledger import Ledger
from dora_jax.core.records import FinishReason, Trajectory
from dora_jax.core.window import window_fits
from tests.coordinator.fakes import FakeWorker, InstantScorer, longtail, prompts


def _pace(publishes, durations):
    pace = legacy_fill.Pace()
    for t in publishes:
        pace.published(t)
    for d in durations:
        pace.group_done(d)
    return pace


def _plan(slices, pace, *, now, unconsumed=None, latest=2, next_take=2, running=()):
    return legacy_fill.plan(
        slices,
        latest=latest,
        next_take=next_take,
        k=3,
        train_batch_size=8,
        group_size=4,
        unconsumed=unconsumed or {},
        now=now,
        pace=pace,
        running_ages=running,
    )


def test_window_fits_counts_what_each_take_must_absorb():
    # next take at 5, K = 2: below 4 at most 1 batch, below 5 at most 2, below 6 (everything <= 5) 3.
    assert window_fits({3: 8, 4: 8, 5: 8}, 5, 2, 8)
    assert not window_fits({3: 9}, 5, 2, 8)
    assert not window_fits({3: 4, 4: 13}, 5, 2, 8)
    assert not window_fits({5: 25}, 5, 2, 8)
    assert not window_fits({2: 1}, 5, 2, 8)  # already older than the next take may consume


def test_pace_needs_two_publishes_and_one_group_and_counts_running_ages():
    pace = legacy_fill.Pace()
    assert pace.step_s() is None and pace.longest_group_s([]) is None
    pace = _pace([0.0, 10.0, 30.0], [4.0, 7.0])
    assert pace.step_s() == 15.0 and pace.last_publish == 30.0
    assert pace.longest_group_s([3.0]) == 7.0 and pace.longest_group_s([9.0]) == 9.0


def test_fills_whole_groups_only_where_the_group_can_finish_before_its_last_take():
    pace = _pace([0.0, 10.0, 20.0], [5.0])  # 10 s steps, groups take 5 s
    v1 = legacy_fill.OldSlice(slice_id=0, version=1, free=9)  # deadline: publish of v4 at 20 + 2 x 10
    v0 = legacy_fill.OldSlice(slice_id=1, version=0, free=8)  # deadline: publish of v3 at 30
    v_late = legacy_fill.OldSlice(slice_id=2, version=-1, free=8)  # its last take (v2) is now: none
    assert _plan([v1, v0, v_late], pace, now=21.0) == [(1, 2), (0, 2)]  # oldest first, 9 free -> 2 groups
    assert _plan([v1, v0], pace, now=26.0) == [(0, 2)]  # 26 + 5 > 30: v0 is too late now
    assert _plan([v1, v0], pace, now=21.0, running=(20.0,)) == []  # a group running 20 s: nothing fits
    assert _plan([v1], _pace([20.0], [5.0]), now=21.0) == []  # no step time observed yet: no basis


def test_fills_only_what_the_window_can_still_absorb():
    pace = _pace([0.0, 10.0, 20.0], [5.0])
    v1 = legacy_fill.OldSlice(slice_id=0, version=1, free=16)
    # next take at 2, K = 3: everything <= 2 must fit in 4 batches (32); 24 unconsumed leave 2 groups.
    assert _plan([v1], pace, now=21.0, unconsumed={2: 24}) == [(0, 2)]
    assert _plan([v1], pace, now=21.0, unconsumed={2: 32}) == []


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _run(legacy: bool, *, seed: int, steps=12, slices=3, slots=8, train_ticks=3, rbs=12, g=4, cap=8):
    """dora on scripted slices with a trainer that trains `train_ticks` ticks per step (the coordinator's
    clock is the tick count). Returns (ledger events, coordinator, trainer wait ticks, idle slot-ticks).

    The defaults are a rollout-bound run whose longest sample (8 tokens) lasts less than two steps,
    the regime where legacy fill can start a group and still have it trained within C3; with
    heavier tails the deadline refuses (as at paper scale: see the simulator's figures)."""
    ref, clock = [None], _Clock()
    length_of = longtail(seed, median=6, cap=cap)
    workers = {i: FakeWorker(i, slots, ref, length_of) for i in range(slices)}
    cfg = CoordinatorConfig(
        mode="dora",
        k_max=3,
        train_batch_size=8,
        rollout_batch_size=rbs,
        group_size=g,
        max_new_tokens=200,
        rebalance_period_s=5.0,
        legacy_fill=legacy,
    )
    ledger = Ledger(None)
    coord = Coordinator(cfg, workers, prompts(), InstantScorer(), ledger, clock=clock)
    ref[0] = coord
    coord.start()
    version, busy_until, waits = 0, None, 0
    while version < steps:
        clock.t += 1
        assert clock.t < 20000, "no progress"
        for w in workers.values():
            w.tick()
        coord.process()
        if busy_until is not None:
            if clock.t < busy_until:
                continue
            version += 1
            coord.post_published(version)
            coord.process()
            busy_until = None
        if version < steps and coord.try_take_batch(version) is not None:
            busy_until = clock.t + train_ticks
        elif version < steps:
            waits += 1
    idle = sum(w.idle_slot_ticks for w in workers.values())
    return ledger.memory, coord, waits, idle


@pytest.mark.parametrize("seed", [0, 1, 3])
def test_legacy_groups_run_at_their_version_keep_c1_c3_and_cost_the_trainer_nothing(seed):
    events_off, _, waits_off, idle_off = _run(False, seed=seed)
    events_on, coord, waits_on, idle_on = _run(True, seed=seed)
    assert audit(events_off).ok and audit(events_on).ok, audit(events_on).summary()
    assert coord.stats.legacy_groups > 0
    latest, legacy = 0, collections.Counter()
    for e in events_on:
        if e["ev"] == "publish":
            latest = e["version"]
        if e["ev"] == "dispatch" and e.get("legacy"):
            assert e["version"] < latest  # started at an older version, on a slice serving it (audit: C1)
            legacy[e["group"]] += 1
    assert len(legacy) == coord.stats.legacy_groups and set(legacy.values()) == {4}  # whole groups
    assert waits_on <= waits_off  # the trainer waits no longer
    assert idle_on < idle_off  # and the old version's idle slots did work


def test_legacy_fill_is_refused_outside_dora():
    cfg = CoordinatorConfig(mode="one_step_off", train_batch_size=8, rollout_batch_size=8, legacy_fill=True)
    with pytest.raises(ValueError, match="coordinator.legacy_fill=True needs mode dora"):
        cfg.validate(2)


def test_pace_takes_decode_time_from_the_workers_and_dispatch_to_finish_for_migrated_samples():
    """Queueing before admission does not count (a legacy group starts at once); a sample whose
    decode time the worker could not measure (migrated) counts from its group's dispatch."""
    ref, clock = [None], _Clock()
    workers = {i: FakeWorker(i, 4, ref, longtail(0)) for i in range(2)}
    cfg = CoordinatorConfig(mode="dora", k_max=2, train_batch_size=8, rollout_batch_size=8, group_size=4)
    coord = Coordinator(cfg, workers, prompts(), InstantScorer(), Ledger(None), clock=clock)
    ref[0] = coord
    coord.start()
    requests = [r for w in workers.values() for r in w.queued]
    by_group = collections.defaultdict(list)
    for r in requests:
        by_group[r.group_id].append(r)
    (g0, first), (g1, second) = sorted(by_group.items())
    clock.t = 10.0

    def finish(group, decode_s):
        trajectories = [
            Trajectory(
                r.traj_id,
                r.group_id,
                r.prompt_id,
                r.prompt_ids,
                (1,),
                (-0.5,),
                r.version,
                (r.version,),
                FinishReason.LENGTH,
                coord.slice_of[r.traj_id],
                decode_s=d,
            )
            for r, d in zip(group, decode_s)
        ]
        for t in trajectories:
            coord.post_finished(t.slice_id, [t])
        coord.process()

    finish(first, [1.0, 2.5, 2.0, 0.5])
    assert coord._pace.longest_group_s([]) == 2.5
    finish(second, [1.0, 0.0, 2.0, 0.5])  # one migrated: 10 s since its group's dispatch
    assert coord._pace.longest_group_s([]) == 10.0
