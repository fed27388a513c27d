"""Failures and restarts, with scripted fake workers: a slice that dies mid-run, and a coordinator
that is lost and restored from a snapshot. The audit over the whole ledger must stay clean."""

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dora_jax.coordinator.audit import audit
from dora_jax.coordinator.ledger import Ledger, read_ledger
from tests.coordinator.fakes import DyingWorker, longtail, make_coordinator

make = make_coordinator


def drive(coord, workers, version, steps, rng, on_tick=None):
    """Ticks random live workers and trains until `steps` versions exist; returns the version."""
    ticks = 0
    while version < steps:
        ticks += 1
        assert ticks < 20000, "no progress"
        if on_tick:
            on_tick(ticks, version)
        order = [w for w in workers.values() if not w.dead]
        rng.shuffle(order)
        for w in order[: rng.randint(1, max(1, len(order)))]:
            w.tick()
        coord.process()
        batch = coord.try_take_batch(version)
        if batch is None:
            continue
        version += 1
        coord.post_published(version)
        coord.process()
    return version


def assert_clean(report, steps, tbs=8):
    assert report.ok, report.summary()
    assert report.consumed == steps * tbs
    assert not report.c1_violations


@pytest.mark.parametrize("mode", ["dora", "one_step_off", "sync"])
def test_a_dead_slice_is_redispatched_under_its_version(mode):
    ledger = Ledger(None)
    coord, workers = make(mode, ledger)
    coord.start()
    killed = []

    def kill(ticks, version):
        victim = workers[1]
        if not killed and version >= 2 and victim.active:
            victim.dead = True
            killed.append(set(victim.active) | {r.traj_id for r in victim.queued})
            coord.post_slice_failed(1, "missed heartbeats")  # what the runner's heartbeat check posts

    drive(coord, workers, 0, 8, random.Random(0), kill)
    report = audit(ledger.memory)
    assert_clean(report, 8)
    failed = [e for e in ledger.memory if e["ev"] == "slice_failed"]
    assert [e["slice"] for e in failed] == [1]
    redispatched = {e["traj"] for e in ledger.memory if e["ev"] == "dispatch" and e.get("redispatch")}
    assert killed[0] <= redispatched and report.redispatched == len(redispatched) == failed[0]["requests"]
    assert 1 not in coord.ports and coord.stats.slice_failures == 1


@pytest.mark.parametrize("mode", ["dora", "sync"])
def test_a_port_call_that_raises_drops_the_slice_instead_of_the_run(mode):
    ledger = Ledger(None)
    coord, workers = make(mode, ledger)
    workers[1].dead = True  # its first command (load_version at start) raises
    coord.start()
    drive(coord, workers, 0, 4, random.Random(0))
    assert_clean(audit(ledger.memory), 4)
    failed = [e for e in ledger.memory if e["ev"] == "slice_failed"]
    assert len(failed) == 1 and failed[0]["slice"] == 1 and "ConnectionError" in failed[0]["reason"]


def test_the_only_slice_of_an_old_version_dies_and_a_drained_slice_takes_its_requests():
    ledger = Ledger(None)
    coord, workers = make("dora", ledger, slices=3, slots=4, k_max=3, tbs=8, rbs=24)
    coord.start()
    seen = []

    def kill(ticks, version):
        if seen:
            return
        alone = [
            s
            for s, v in coord.slice_version.items()
            if v is not None
            and v < coord.latest
            and workers[s].active
            and sum(coord.slice_version[o] == v for o in coord.ports) == 1
        ]
        if alone and version >= 1:
            sid = alone[0]
            workers[sid].dead = True
            seen.append((sid, coord.slice_version[sid]))
            coord.post_slice_failed(sid, "process died")

    drive(coord, workers, 0, 10, random.Random(3), kill)
    assert seen, "the scenario did not arise"
    report = audit(ledger.memory)
    assert_clean(report, 10)
    sid, version = seen[0]
    loads = [e for e in ledger.memory if e["ev"] == "load_version" and e["version"] == version and e["slice"] != sid]
    assert loads, "no live slice loaded the dead slice's version"


def test_every_slice_dead_stops_the_run_with_a_clear_error():
    coord, workers = make("dora", Ledger(None), slices=2)
    coord.start()
    for w in workers.values():
        w.dead = True
    coord.post_slice_failed(0, "gone")
    coord.post_slice_failed(1, "gone")
    with pytest.raises(RuntimeError, match="every rollout slice has failed"):
        coord.process()


def test_a_rejoined_slice_gets_work_again():
    ledger = Ledger(None)
    coord, workers = make("dora", ledger)
    coord.start()
    state = {}

    def fail_then_rejoin(ticks, version):
        if ticks == 30:
            workers[2].dead = True
            coord.post_slice_failed(2, "crashed")
        if ticks == 60:
            fresh = DyingWorker(2, 4, [coord], longtail(0))
            workers[2] = state.setdefault("fresh", fresh)
            coord.post_slice_joined(fresh)

    drive(coord, workers, 0, 10, random.Random(1), fail_then_rejoin)
    assert_clean(audit(ledger.memory), 10)
    assert state["fresh"].prefills > 0 and 2 in coord.ports


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    mode=st.sampled_from(["dora", "one_step_off", "sync", "partial_rollout"]),
    crash_at=st.integers(1, 5),
    extra=st.integers(0, 60),
)
def test_restore_from_a_snapshot_consumes_everything_exactly_once(tmp_path_factory, seed, mode, crash_at, extra):
    """Run, snapshot after a publish, keep running (events the crash will lose), then restore
    into a new coordinator with fresh workers on the same ledger file, and finish."""
    path = str(tmp_path_factory.mktemp("ledger") / "ledger.jsonl")
    ledger = Ledger(path)
    coord, workers = make(mode, ledger, seed=seed)
    coord.start()
    rng = random.Random(seed)
    version = drive(coord, workers, 0, crash_at, rng)
    state = json.loads(json.dumps(coord.snapshot(extra=lambda: {"source": "here"})))
    assert state["extra"] == {"source": "here"}

    def lost_work(ticks, version):  # the doomed process goes on for a while after its checkpoint
        if ticks > extra:
            raise _Crash

    try:
        drive(coord, workers, version, 10, rng, lost_work)
    except _Crash:
        pass
    ledger.close()

    ledger2 = Ledger(path)
    coord2, workers2 = make(mode, ledger2, seed=seed, initial_version=version)
    coord2.restore(state)
    coord2.start()
    drive(coord2, workers2, version, 8, random.Random(seed + 1))
    ledger2.close()
    report = audit(read_ledger(path))
    assert report.resumes == 1
    assert report.ok, report.summary()
    assert report.consumed == 8 * 8
    if mode != "partial_rollout":
        assert not report.c1_violations
    resumed = [e for e in read_ledger(path) if e["ev"] == "resume"][0]
    assert resumed["in_flight"] == len(state["dispatched"])


class _Crash(Exception):
    pass


def test_snapshot_keeps_tokens_so_far_and_they_are_not_regenerated():
    ledger = Ledger(None)
    coord, workers = make("dora", ledger)
    coord.start()
    for _ in range(3):
        for w in workers.values():
            w.tick()
        coord.process()
    state = json.loads(json.dumps(coord.snapshot()))  # as a checkpoint stores it
    prefixed = [r for r in state["dispatched"] if r["prefix_response_ids"]]
    assert prefixed, "nothing was mid-generation"
    coord2, workers2 = make("dora", Ledger(None), initial_version=0)
    coord2.restore(state)
    coord2.start()
    total_prefill = sum(len(r["prefix_response_ids"]) for r in prefixed)
    assert coord2.ledger.memory[0]["ev"] == "resume" and coord2.ledger.memory[0]["prefix_tokens"] == total_prefill
    requeued = [r for w in workers2.values() for r in w.queued]
    assert len(requeued) == len(state["dispatched"]) + len(state["backlog"])
    by_id = {p["traj_id"]: p for p in state["dispatched"] + state["backlog"]}
    for r in requeued:  # each continues from its tokens so far, under its own version
        assert list(r.prefix_response_ids) == by_id[r.traj_id]["prefix_response_ids"]
        assert r.version == by_id[r.traj_id]["version"]
