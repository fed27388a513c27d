"""The coordinator driven by scripted fake workers: C1-C3 and exactly-once under every mode."""

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dora_jax.coordinator.audit import audit
from dora_jax.coordinator.coordinator import Coordinator, CoordinatorConfig
from dora_jax.coordinator.ledger import Ledger
from tests.coordinator.fakes import FakeWorker, InstantScorer, config, drive, longtail, prompts, tick_some


def run(
    mode,
    *,
    steps=6,
    slices=3,
    slots=4,
    k_max=2,
    tbs=8,
    rbs=16,
    g=4,
    seed=0,
    fail_every=0,
    observe=None,
    reprefill_every=0,
    pull_fails_every=0,
):
    """Drives the coordinator to `steps` takes; `observe(phase, coord)` runs after each take and publish."""
    ref = [None]
    length_of = longtail(seed)
    workers = {
        i: FakeWorker(i, slots, ref, length_of, reprefill_every=reprefill_every, pull_fails_every=pull_fails_every)
        for i in range(slices)
    }
    cfg = config(mode, k_max=k_max, tbs=tbs, rbs=rbs, g=g)
    ledger = Ledger(None)
    coord = Coordinator(cfg, workers, prompts(), InstantScorer(fail_every), ledger)
    ref[0] = coord
    coord.start()
    rng = random.Random(seed)
    version, waits_with_work, ticks = 0, 0, 0
    while version < steps:
        ticks += 1
        assert ticks < 20000, "no progress"
        tick_some(workers, rng)
        coord.process()
        batch = coord.try_take_batch(version)
        if batch is None:
            waits_with_work += _window_allows(coord, version)
            continue
        assert sum(len(grp.samples) for grp in batch) == tbs
        assert all(len({s.trajectory.version for s in grp.samples}) == 1 for grp in batch)  # groups never mix versions
        if observe:
            observe("take", coord)
        version += 1
        coord.post_published(version)
        coord.process()
        if observe:
            observe("publish", coord)
    return coord, workers, audit(ledger.memory), waits_with_work


def _window_allows(coord, version):
    """Independent oracle: could the trainer have advanced?"""
    need = coord.config.train_batch_size // coord.config.group_size
    groups = sorted(g.version for g in coord.queue.peek_oldest(len(coord.queue)))
    if len(groups) < need:
        return 0
    rest = [v for v in groups[need:] for _ in range(coord.config.group_size)]
    rest += [r.version for r in coord.requests.values()] + [r.version for r in coord.backlog]
    for group in coord.groups.values():  # finished samples of incomplete groups
        rest += [group.version] * len(group.scored)
    tbs, k = coord.config.train_batch_size, coord.config.window
    return int(all(sum(v < version + 1 + m - k for v in rest) <= m * tbs for m in range(k + 1)))


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "dora"])
def test_modes_keep_their_promises(mode):
    coord, workers, report, waits = run(mode)
    assert report.ok, report.summary()
    assert report.consumed == 6 * 8 and not report.c1_violations
    assert waits == 0  # the trainer never waited when the window allowed it
    expected_max = {"sync": 0, "one_step_off": 1, "dora": 2}[mode]
    assert report.max_staleness <= expected_max
    if mode == "sync":
        assert set(report.staleness_histogram) == {0}
    if mode == "one_step_off":
        assert set(report.staleness_histogram) <= {0, 1} and report.staleness_histogram.get(1, 0) > 0


def test_streaming_keeps_one_more_batch_unconsumed_between_a_publish_and_the_next_take():
    """C3 lets version t's samples train at trainer versions t..t+K: K + 1 takes until the trainer
    takes at t, K after. So up to (K + 1) x TBS unconsumed after a publish, K x TBS after a take."""
    peaks = {"take": 0, "publish": 0}

    def observe(phase, coord):
        peaks[phase] = max(peaks[phase], coord._unconsumed())

    _, _, report, waits = run("dora", steps=10, slices=3, slots=8, k_max=2, tbs=8, rbs=24, observe=observe)
    assert report.ok and report.max_staleness == 2 and waits == 0
    assert peaks == {"take": 2 * 8, "publish": 3 * 8}


def test_dora_runs_versions_concurrently_and_migrates_with_kv():
    coord, workers, report, _ = run("dora", steps=10)
    assert report.ok
    assert report.max_versions_in_flight >= 2
    assert report.migrations_kv > 0
    assert coord.stats.migrations_kv == sum(w.imports_kv for w in workers.values())


def test_migrations_by_reprefill_keep_every_invariant_and_say_so_in_the_ledger():
    """Slices whose migration rule re-prefills every other admitted request they export: the
    ledger's migrate lines say how each moved, and C1-C3 and exactly-once hold."""
    coord, workers, report, _ = run("dora", steps=10, reprefill_every=2)
    assert report.ok, report.summary()
    assert report.migrations_reprefill > 0 and report.migrations_kv > 0
    assert coord.stats.migrations_reprefill == report.migrations_reprefill
    assert coord.stats.migrations_kv == sum(w.imports_kv for w in workers.values()) == report.migrations_kv
    assert report.migrations_no_kv == coord.stats.migrations_reprefill + coord.stats.migrations_queued
    assert report.max_staleness <= 2


def test_a_slot_whose_kv_could_not_be_pulled_is_written_as_reprefilled():
    """Destinations that fail every other KV pull re-prefill those slots and say so: the ledger's
    migrate lines (and the stats) count them as re-prefills, not as KV moves."""
    coord, workers, report, _ = run("dora", steps=10, pull_fails_every=2)
    assert report.ok, report.summary()
    fell_back = sum(w._imported - w.imports_kv for w in workers.values())
    assert fell_back > 0 and report.migrations_kv > 0
    assert coord.stats.migrations_kv == sum(w.imports_kv for w in workers.values()) == report.migrations_kv
    assert coord.stats.migrations_reprefill == report.migrations_reprefill == fell_back


def test_partial_rollout_shows_c1_violations():
    coord, _, report, _ = run("partial_rollout", steps=8)
    assert report.c1_violations, "partial rollout must mix versions inside trajectories"
    assert report.ok  # its mode does not promise C1; C2, C3 and exactly-once still hold
    assert coord.stats.interrupts > 0


def test_dora_bubbles_fewer_than_sync():
    idle = {}
    for mode in ("sync", "dora"):
        _, workers, report, _ = run(mode, steps=8, seed=3, k_max=3, rbs=16)
        assert report.ok
        idle[mode] = sum(w.idle_slot_ticks for w in workers.values()) / sum(w.slot_ticks for w in workers.values())
    assert idle["dora"] < 0.7 * idle["sync"], idle


def test_reward_failures_are_masked_not_dropped():
    coord, _, report, _ = run("dora", fail_every=5)
    assert report.ok and coord.stats.reward_failures > 0


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    slices=st.integers(1, 4),
    slots=st.integers(1, 6),
    k_max=st.integers(1, 3),
    mode=st.sampled_from(["sync", "one_step_off", "dora", "partial_rollout"]),
)
def test_invariants_under_random_scheduling(seed, slices, slots, k_max, mode):
    coord, _, report, waits = run(
        mode, steps=4, slices=slices, slots=slots, k_max=k_max, tbs=8, rbs=8 * (k_max + 1), g=4, seed=seed
    )
    assert report.ok, report.summary()
    assert report.consumed == 4 * 8
    assert waits == 0
    # exactly once: every dispatched sample is consumed or still unconsumed at the end
    assert report.dispatched == report.consumed + report.in_flight_at_end + report.unconsumed_finished_at_end


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(k_max=0), "k_max=0"),
        (dict(train_batch_size=10), "train_batch_size=10 is not a multiple"),
        (dict(rollout_batch_size=4), "rollout_batch_size=4 < train_batch_size"),
        (dict(rollout_batch_size=64), "rollout_batch_size=64 exceeds"),
        (dict(mode="bogus"), "'bogus' is not a valid Mode"),
    ],
)
def test_invalid_config_names_the_field(changes, field):
    base = dict(mode="dora", k_max=2, train_batch_size=8, rollout_batch_size=16, group_size=4)
    with pytest.raises(ValueError, match=field):
        CoordinatorConfig(**{**base, **changes}).validate(2)


def test_no_batch_before_the_publish_is_applied():
    """The trainer posts a publish and asks for its next batch at once; until the coordinator has
    applied the publish, new prompts would be tagged with the old version, so no batch is given."""
    coord, workers, report, _ = run("dora", steps=2, k_max=1, rbs=8)  # one batch unconsumed at a time
    for _ in range(200):
        for w in workers.values():
            w.tick()
        coord.process()
    coord.post_published(3)  # the trainer is at version 3 now
    assert len(coord.queue) * 4 >= 8  # enough finished samples for a batch are waiting
    assert coord.try_take_batch(3) is None
    coord.process()
    assert coord.latest == 3


def test_a_peek_shows_each_finished_sample_once_oldest_first_and_takes_nothing():
    """peek_batch (trainer.score_ahead): finished samples the trainer will train on, each shown
    once (until taken), oldest version first, at most a train batch of them, as groups (a group
    still decoding shows the samples it has finished); nothing is consumed or written by it; []
    for a trainer version whose publish the coordinator has not applied yet. A trainer that peeks
    until a peek is empty before each take has seen every sample of every batch it takes."""
    ref, length_of = [None], longtail(0)
    workers = {i: FakeWorker(i, 4, ref, length_of) for i in range(3)}
    ledger = Ledger(None)
    coord = Coordinator(config("dora", k_max=2, tbs=8, rbs=16, g=4), workers, prompts(), InstantScorer(0), ledger)
    ref[0] = coord
    coord.start()
    rng, version, shown, partial = random.Random(0), 0, set(), 0
    for _ in range(20000):
        if version == 6:
            break
        tick_some(workers, rng)
        coord.process()
        written, queued = len(ledger.memory), len(coord.queue)
        assert coord.peek_batch(version + 1) == []  # that version's publish has not been applied
        peeked = coord.peek_batch(version)
        assert len(ledger.memory) == written and len(coord.queue) == queued  # nothing taken, nothing written
        ids = [s.trajectory.traj_id for g in peeked for s in g.samples]
        assert len(ids) <= 8 and not set(ids) & shown, (ids, shown)
        assert [g.version for g in peeked] == sorted(g.version for g in peeked)
        assert all({s.trajectory.traj_id.rsplit("/", 1)[0] for s in g.samples} == {g.group_id} for g in peeked)
        partial += sum(len(g.samples) < 4 for g in peeked)
        shown |= set(ids)
        if len(ids) == 8:
            continue  # a full peek: more may be waiting
        assert coord.peek_batch(version) == []  # everything finished was shown
        batch = coord.try_take_batch(version)
        if batch is None:
            continue
        taken = {s.trajectory.traj_id for g in batch for s in g.samples}
        assert taken <= shown  # shown by a peek before the take
        shown -= taken
        version += 1
        coord.post_published(version)
        coord.process()
    assert version == 6 and partial > 0 and audit(ledger.memory).ok


@pytest.mark.parametrize("legacy_fill", [False, True], ids=["plain", "legacy_fill"])
@pytest.mark.parametrize("seed", [0, 1])
def test_committed_groups_are_whole_shown_once_and_in_the_next_take(seed, legacy_fill):
    """peek_batch(committed=True) (trainer.grad_ahead): whole queued groups, each shown once, that
    the take for that version holds. Without legacy fill nothing can break a commitment (only older
    groups in flight could sort ahead, and they are counted); with it, a group started later at an
    older version may: the take stays the oldest groups and counts the commitment broken. Every
    take is the one a coordinator without commitments makes, and the audit is clean."""
    ref, length_of = [None], longtail(seed)
    workers = {i: FakeWorker(i, 4, ref, length_of) for i in range(3)}
    ledger = Ledger(None)
    cfg = dataclasses.replace(config("dora", k_max=2, tbs=16, rbs=32, g=4), legacy_fill=legacy_fill)
    coord = Coordinator(cfg, workers, prompts(), InstantScorer(0), ledger)
    ref[0] = coord
    coord.start()
    rng, version, committed, ticks = random.Random(seed), 0, {}, 0
    while version < 8:
        ticks += 1
        assert ticks < 20000, "no progress"
        tick_some(workers, rng)
        coord.process()
        shown = coord.peek_batch(version, committed=True)
        assert coord.peek_batch(version + 1, committed=True) == []  # that publish is not applied yet
        assert all(len(g.samples) == 4 for g in shown) and not {g.group_id for g in shown} & set(committed)
        committed.update((g.group_id, version) for g in shown)
        oldest = [g.group_id for g in coord.queue.peek_oldest(4)]
        batch = coord.try_take_batch(version)
        if batch is None:
            continue
        assert [g.group_id for g in batch] == oldest  # the take is oldest first, commitments or not
        mine = {gid for gid, v in committed.items() if v == version}
        if not legacy_fill:
            assert mine <= {g.group_id for g in batch}
        version += 1
        coord.post_published(version)
        coord.process()
    held = sum(v < version for v in committed.values())
    assert coord.stats.committed_groups == len(committed) and held >= 8, (coord.stats, held)
    if not legacy_fill:
        assert coord.stats.commitments_broken == 0
    assert audit(ledger.memory).ok


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class _TimedWorker(FakeWorker):
    """A fake slice whose commands take known (fake-clock) seconds, counted per method."""

    COST = {"submit": 0.01, "load_version": 0.5, "export": 0.1, "import_": 0.2}

    def __init__(self, clock, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.clock, self.calls = clock, {m: 0 for m in self.COST}

    def _took(self, method):
        self.calls[method] += 1
        self.clock.t += self.COST[method]

    def submit(self, requests):
        self._took("submit")
        return super().submit(requests)

    def load_version(self, version):
        self._took("load_version")
        return super().load_version(version)

    def export(self, traj_ids, kv=True):
        self._took("export")
        return super().export(traj_ids, kv)

    def import_(self, items):
        self._took("import_")
        return super().import_(items)


def _timed_run(mode, steps=6):
    """(coordinator, timed workers, ledger events) after `steps` takes on 3 slices of 4 slots."""
    clock, ref = _Clock(), [None]
    length_of = longtail(0)
    workers = {i: _TimedWorker(clock, i, 4, ref, length_of) for i in range(3)}
    ledger = Ledger(None)
    coord = Coordinator(config(mode), workers, prompts(), InstantScorer(), ledger, clock=clock)
    ref[0] = coord
    coord.start()

    def a_second_passes():
        clock.t += 1.0

    drive(coord, workers, random.Random(0), steps, each_pass=a_second_passes)
    return coord, workers, ledger.memory


def test_the_loops_waits_on_slice_commands_are_counted_by_method():
    """`stats.port_wait_s`: the seconds the loop waited on each kind of command (the coordinator's
    clock across the port call), which the bench reports per mode."""
    coord, workers, events = _timed_run("dora")
    assert audit(events).ok
    calls = {m: sum(w.calls[m] for w in workers.values()) for m in _TimedWorker.COST}
    assert calls["load_version"] >= 3 and calls["submit"] > 0 and calls["export"] > 0  # dora migrates
    expected = {m: n * _TimedWorker.COST[m] for m, n in calls.items() if n}
    assert coord.stats.port_wait_s.keys() == expected.keys()
    for method, seconds in expected.items():
        assert coord.stats.port_wait_s[method] == pytest.approx(seconds), method


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "partial_rollout"])
def test_a_backlog_goes_to_each_slice_in_one_submit(mode):
    """The modes that switch idle slices send their backlog with one submit per slice and pass
    (a submit returns once the worker has queued it: one per request spread a batch over as many
    of the worker's steps)."""
    coord, workers, events = _timed_run(mode)
    assert audit(events).ok
    submits = sum(w.calls["submit"] for w in workers.values())
    dispatches = sum(e["ev"] == "dispatch" for e in events)
    assert dispatches >= 6 * 8  # 6 batches of 8
    # at most one submit per slice for each pass that dispatched: far fewer than the dispatches
    assert submits <= dispatches // 2, (submits, dispatches)


def test_the_trainers_wait_says_when_c3_held_a_queued_batch():
    """`stats.trainer_wait_c3_s`: the part of the trainer's wait during which a whole batch was
    queued but C3 held the take, because an older group still decoding would be more than K
    versions stale after it; none of a wait for results counts."""
    # K = 1, batches of 2 groups of 4: version 0's fourth group (g3) decodes for ever, the rest finish
    # in one token.
    ref = [None]
    workers = {i: FakeWorker(i, 4, ref, lambda traj_id: 150 if traj_id.startswith("g3/") else 1) for i in range(3)}
    coord = Coordinator(config("dora", k_max=1, tbs=8, rbs=16, g=4), workers, prompts(), InstantScorer(), Ledger(None))
    ref[0] = coord
    coord.start()
    with pytest.raises(TimeoutError):
        coord.take_batch(0, timeout=0.2)  # nothing finished yet: waiting for results
    assert coord.stats.trainer_wait_s >= 0.2 and coord.stats.trainer_wait_c3_s == 0.0
    for _ in range(2):
        for w in workers.values():
            w.tick()
        coord.process()
    assert [g.group_id for g in coord.take_batch(0, timeout=5.0)] == ["g0", "g1"]
    coord.post_published(1)
    coord.process()
    for _ in range(2):
        for w in workers.values():
            w.tick()
        coord.process()
    # Queued: g2 (v0) and version 1's groups; a take of two would leave g3 (v0) for trainer version 2.
    assert len(coord.queue) >= 2 and "g3" in coord.groups
    waited = coord.stats.trainer_wait_s
    with pytest.raises(TimeoutError):
        coord.take_batch(1, timeout=0.3)
    assert coord.stats.trainer_wait_c3_s == pytest.approx(coord.stats.trainer_wait_s - waited, abs=0.06)
    assert coord.stats.trainer_wait_c3_s >= 0.25
