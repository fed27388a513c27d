"""Failures and restarts, with scripted fake workers: a slice that dies mid-run, and a coordinator
that is lost and restored from a snapshot. The audit over the whole ledger must stay clean."""

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dora_jax.coordinator.audit import audit
from dora_jax.coordinator.ledger import Ledger, read_ledger
from tests.coordinator.fakes import DyingWorker, InstantScorer, config, longtail, make_coordinator

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


@pytest.mark.parametrize("mode", ["dora", "sync"])
def test_every_slice_down_at_once_waits_for_the_restarts_it_was_promised(mode):
    """A supervisor that will start a dropped slice again says so (`on_slice_dropped` returns
    True): with every slice down at once the run waits for them instead of stopping (the embedded
    run died so in CI when a hung slice held the loop past the others' restarts), then finishes
    clean; a slice that will not come back still stops the run once none is left."""
    ledger = Ledger(None)
    promised = []
    coord, workers = make(mode, ledger, slices=2, on_slice_dropped=lambda sid, why: promised.append(sid) or True)
    coord.start()

    def all_down_then_back(ticks, version):
        if ticks == 30:
            for sid, w in workers.items():
                w.dead = True
                coord.post_slice_failed(sid, "crashed")
        if ticks == 31:
            assert not coord.ports and coord.backlog  # nothing to run on; its requests wait
        if ticks == 40:
            for sid in (0, 1):
                workers[sid] = DyingWorker(sid, 4, [coord], longtail(sid))
                coord.post_slice_joined(workers[sid])

    drive(coord, workers, 0, 8, random.Random(2), all_down_then_back)
    assert sorted(promised) == [0, 1]
    assert_clean(audit(ledger.memory), 8)

    answers = {1: [False], 0: [True, False]}  # slice 0 comes back once; then its rejoins are spent
    coord, workers = make(mode, Ledger(None), slices=2, on_slice_dropped=lambda sid, why: answers[sid].pop(0))
    coord.start()
    for w in workers.values():
        w.dead = True
    coord.post_slice_failed(1, "gone")
    coord.post_slice_failed(0, "gone")
    coord.process()  # slice 0 will be back: no error yet
    coord.post_slice_joined(DyingWorker(0, 4, [coord], longtail(0)))
    coord.process()
    coord.ports[0].dead = True
    coord.post_slice_failed(0, "gone again")
    with pytest.raises(RuntimeError, match="every rollout slice has failed"):
        coord.process()

    # a promised restart that its supervisor gives up on (a hung thread never let go)
    coord, workers = make(mode, Ledger(None), slices=1, on_slice_dropped=lambda sid, why: True)
    coord.start()
    workers[0].dead = True
    coord.post_slice_failed(0, "hung")
    coord.process()
    coord.post_slice_wont_rejoin(0, "not restarted: its hung thread held the engine for 101s")
    with pytest.raises(RuntimeError, match="slice 0: not restarted"):
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


class _Source:
    def state(self):
        return {"next": 0}


class _BookScorer(InstantScorer):
    """Scores only trajectories whose prompt the book still holds (as the reward pool needs it)."""

    def __init__(self, book):
        super().__init__()
        self.book = book

    def submit(self, trajectory):
        assert trajectory.prompt_id in self.book, f"{trajectory.prompt_id} forgotten before its reward"
        return super().submit(trajectory)


def test_the_prompt_book_forgets_what_nothing_live_refers_to_and_a_checkpoint_keeps_the_rest(tmp_path):
    """resume.PromptBook (the runner's and the gRPC coordinator's prompts) over a long-tailed dora
    run with a slice dying: every reward finds its prompt, the book stays near what is in flight
    instead of every prompt drawn, the held-out prompts stay, and a snapshot's prompts (taken under
    the coordinator's lock) cover every request and unscored trajectory it holds."""
    from dora_jax.coordinator.coordinator import Coordinator
    from dora_jax.runtime import resume
    from dora_jax.tasks.prompt import Prompt

    book = resume.PromptBook(min_pass=8)
    held_out = [Prompt("eval-0", "4 5", (4, 5), "42")]
    book.keep(held_out)
    counter = iter(range(10**9))

    def next_prompt():
        prompt = Prompt(f"p{next(counter)}", "1 2 3", (1, 2, 3), "7")
        book.add(prompt)
        return prompt.prompt_id, prompt.prompt_ids

    ref, length_of = [None], longtail(3)
    workers = {i: DyingWorker(i, 4, ref, length_of) for i in range(3)}
    ledger = Ledger(str(tmp_path / "ledger.jsonl"))
    coord = Coordinator(config("dora", k_max=2, tbs=8, rbs=16, g=4), workers, next_prompt, _BookScorer(book), ledger)
    ref[0] = coord
    book.follow(coord)
    coord.start()
    sizes, states = [], []

    def watch(ticks, version):
        sizes.append(len(book))
        if ticks == 40:
            workers[1].dead = True
            coord.post_slice_failed(1, "missed heartbeats")
        if ticks % 10 == 0 and not workers[1].dead:  # (a dead fake raises even on hasattr)
            states.append(coord.snapshot(extra=lambda: book.snapshot_extra(_Source())))

    drive(coord, workers, 0, 30, random.Random(3), watch)
    ledger.close()
    assert_clean(audit(read_ledger(str(tmp_path / "ledger.jsonl"))), 30)
    drawn = next(counter)
    assert book.forgotten > 0 and max(sizes) < drawn / 2, (max(sizes), drawn)
    assert max(sizes) <= 2 * (16 + 8) + 1  # what is in flight (rbs 16 + a batch unscored) and one pass's growth
    assert "eval-0" in book
    assert states
    for state in states:
        referred = {r["prompt_id"] for r in state["dispatched"] + state["backlog"]}
        referred |= {t["prompt_id"] for t in state["unscored"]}
        assert referred <= set(state["extra"]["prompts"])
