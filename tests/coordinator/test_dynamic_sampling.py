"""Dynamic sampling on the coordinator (dora_jax/coordinator/dynamic_sampling.py), driven by scripted
fake workers and a reward that saturates three groups in four: every batch taken holds TBS samples
of groups with reward variance, the rest are filtered in the ledger and replaced, and the audit
accounts for them (and fails when a ledger is tampered with)."""

import dataclasses
import json
import random
from concurrent.futures import Future

import pytest

from dora_jax.coordinator import dynamic_sampling
from dora_jax.coordinator.audit import audit
from dora_jax.coordinator.coordinator import Coordinator
from dora_jax.coordinator.ledger import Ledger, read_ledger
from tests.coordinator.fakes import DyingWorker, config, longtail, prompts

TBS, G = 8, 4


class SaturatingScorer:
    """Group gN has reward variance only when N % 4 == 1 (sample i scores i % 2); groups with
    N % 4 == 0 are all right, the others all wrong. `informative_every=0`: every group saturates."""

    def __init__(self, informative_every: int = 4):
        self.informative_every = informative_every

    def submit(self, trajectory):
        group, index = trajectory.traj_id.split("/")
        n = int(group[1:])
        if self.informative_every and n % self.informative_every == 1:
            reward = float(int(index) % 2)
        else:
            reward = 1.0 if n % 4 == 0 else 0.0
        future = Future()
        future.set_result((reward, None))
        return future


def informative(group_id: str) -> bool:
    return int(group_id[1:]) % 4 == 1


def make(mode, ledger, *, seed=0, scorer=None, initial_version=0, max_batches=10, dynamic=True):
    ref = [None]
    length_of = longtail(seed)
    workers = {i: DyingWorker(i, 4, ref, length_of) for i in range(3)}
    cfg = dataclasses.replace(
        config(mode, tbs=TBS, rbs=16, g=G), dynamic_sampling=dynamic, max_filtered_batches_per_step=max_batches
    )
    coord = Coordinator(cfg, workers, prompts(), scorer or SaturatingScorer(), ledger, initial_version=initial_version)
    ref[0] = coord
    return coord, workers


def drive(coord, workers, version, steps, rng, batches=None, on_tick=None):
    """Ticks random live workers and trains until `steps` versions exist; returns the version."""
    ticks = 0
    while version < steps:
        ticks += 1
        assert ticks < 50000, "no progress"
        if on_tick:
            on_tick(ticks)
        order = list(workers.values())
        rng.shuffle(order)
        for w in order[: rng.randint(1, len(order))]:
            w.tick()
        coord.process()
        batch = coord.try_take_batch(version)
        if batch is None:
            continue
        if batches is not None:
            batches.append(batch)
        version += 1
        coord.post_published(version)
        coord.process()
    return version


def test_why_a_group_is_uninformative():
    why = dynamic_sampling.why_uninformative
    assert why([1.0, 0.0, 1.0, 1.0], [True] * 4) is None
    assert why([1.0, 1.0, 1.0, 1.0], [True] * 4) == "all rewards equal"
    assert why([0.0, 0.0, 0.0, 0.0], [True] * 4) == "all rewards equal"
    assert why([0.2, 0.9, 7.0, 0.2], [True, True, False, True]) is None  # as the trainer's mask: 0.2 != 0.9
    assert why([1.0, 0.0, 0.0, 0.0], [False, True, True, True]) == "all rewards equal"  # the 1.0 is masked
    assert why([1.0, 0.0], [True, False]) == "one valid reward"
    assert why([1.0, 0.0], [False, False]) == "no valid reward"
    with pytest.raises(ValueError, match="2 rewards but 1 validity flags"):
        why([1.0, 0.0], [True])


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "partial_rollout", "dora"])
def test_every_batch_holds_tbs_samples_of_groups_with_variance(mode):
    ledger = Ledger(None)
    coord, workers = make(mode, ledger)
    coord.start()
    batches = []
    drive(coord, workers, 0, 6, random.Random(0), batches)
    for batch in batches:
        assert sum(len(g.samples) for g in batch) == TBS
        for group in batch:
            assert informative(group.group_id)
            assert sorted(s.reward for s in group.samples) == [0.0, 0.0, 1.0, 1.0]
    events = ledger.memory
    scores = {e["group"]: e for e in events if e["ev"] == "score"}
    filtered = {e["group"]: e for e in events if e["ev"] == "filtered"}
    # Exactly the saturated groups among the completed ones are filtered, each with why and its samples.
    assert set(filtered) == {g for g in scores if not informative(g)}
    assert all(f["why"] == "all rewards equal" and f["trajs"] == scores[g]["trajs"] for g, f in filtered.items())
    assert coord.stats.filtered_groups == len(filtered) and coord.stats.filtered_samples == G * len(filtered)
    assert coord.stats.scored_groups == len(scores)
    report = audit(events)
    assert report.ok, report.summary()
    assert report.dynamic_sampling and report.consumed == 6 * TBS
    assert report.filtered == G * len(filtered) and report.filtered_groups == len(filtered)
    assert report.stranded == 0
    if mode == "sync":
        # Replaced one for one, nothing made beyond the batch: the 2s-th informative group is g(8s - 3),
        # so 6 steps drew g0..g45 and filtered the 46 - 12 = 34 others; staleness stays 0.
        assert len(scores) == 46 and len(filtered) == 34
        assert set(report.staleness_histogram) == {0}
    if mode == "one_step_off":
        assert set(report.staleness_histogram) <= {0, 1}


def test_without_dynamic_sampling_nothing_is_filtered_and_rewards_are_still_recorded():
    ledger = Ledger(None)
    coord, workers = make("dora", ledger, dynamic=False)
    coord.start()
    batches = []
    drive(coord, workers, 0, 4, random.Random(1), batches)
    assert not [e for e in ledger.memory if e["ev"] == "filtered"]
    assert sum(not informative(g.group_id) for batch in batches for g in batch) > 0  # saturated groups trained
    scores = [e for e in ledger.memory if e["ev"] == "score"]
    assert len(scores) == coord.stats.scored_groups > 0
    report = audit(ledger.memory)
    assert report.ok and not report.dynamic_sampling and report.filtered == 0


def test_a_saturated_run_stops_with_a_clear_error_instead_of_drawing_forever():
    ledger = Ledger(None)
    coord, workers = make("dora", ledger, scorer=SaturatingScorer(informative_every=0), max_batches=3)
    coord.start()
    # 3 batches of TBS / G = 2 groups: the 7th group filtered since the last take stops the run.
    expected = (
        r"dynamic sampling: 7 groups filtered \(no reward variance\) before the first take, "
        r"more than coordinator.max_filtered_batches_per_step=3 batches of 2 groups"
    )
    with pytest.raises(RuntimeError, match=expected):
        drive(coord, workers, 0, 1, random.Random(0))
    assert coord.stats.filtered_groups == 7
    assert len([e for e in ledger.memory if e["ev"] == "filtered"]) == 7


def test_the_filter_budget_counts_from_the_last_take():
    budget = dynamic_sampling.FilterBudget(config("dora", tbs=TBS, g=G))  # 10 batches of 2 groups
    for _ in range(20):
        budget.spend(taken_at=0)
    budget.taken()
    for _ in range(20):
        budget.spend(taken_at=1)
    with pytest.raises(RuntimeError, match="21 groups filtered"):
        budget.spend(taken_at=1)
    unlimited = dynamic_sampling.FilterBudget(dataclasses.replace(config("dora"), max_filtered_batches_per_step=0))
    for _ in range(1000):
        unlimited.spend(taken_at=0)


def test_a_negative_budget_is_refused_naming_the_field():
    cfg = dataclasses.replace(config("dora"), max_filtered_batches_per_step=-1)
    with pytest.raises(ValueError, match="coordinator.max_filtered_batches_per_step=-1; expected >= 0"):
        cfg.validate(1)


def _clean_ledger():
    ledger = Ledger(None)
    coord, workers = make("dora", ledger)
    coord.start()
    drive(coord, workers, 0, 4, random.Random(2))
    events = [dict(e) for e in ledger.memory]
    assert audit(events).ok
    return events


def test_the_audit_fails_when_a_filtered_sample_is_consumed():
    events = _clean_ledger()
    filtered = next(e for e in events if e["ev"] == "filtered")
    consume = next(e for e in events if e["ev"] == "consume")
    events.append(dict(consume, traj=filtered["trajs"][0], group=filtered["group"], version=filtered["version"]))
    report = audit(events)
    assert not report.ok
    assert report.exactly_once_violations == [f"{filtered['trajs'][0]}: consumed after it was filtered"]


def test_the_audit_fails_when_a_consumed_group_had_no_reward_variance():
    events = _clean_ledger()
    consumed = next(e["group"] for e in events if e["ev"] == "consume")
    score = next(e for e in events if e["ev"] == "score" and e["group"] == consumed)
    score["rewards"] = [1.0] * G  # the ledger now says the trainer got a group of equal rewards
    report = audit(events)
    assert not report.ok
    assert report.dynamic_sampling_violations == [
        f"group {consumed}: consumed with no reward variance (all rewards equal)"
    ]


def test_the_audit_fails_when_an_informative_group_is_filtered_or_nothing_may_be_filtered():
    events = _clean_ledger()
    filtered = next(e for e in events if e["ev"] == "filtered")
    score = next(e for e in events if e["ev"] == "score" and e["group"] == filtered["group"])
    score["rewards"] = [0.0, 1.0, 0.0, 1.0]
    assert audit(events).dynamic_sampling_violations == [f"group {filtered['group']}: filtered, but its rewards vary"]
    events = _clean_ledger()
    run = next(e for e in events if e["ev"] == "run")
    run["dynamic_sampling"] = False
    report = audit(events)
    filtered_groups = sum(e["ev"] == "filtered" for e in events)
    assert len(report.dynamic_sampling_violations) == filtered_groups > 0 and not report.ok


def test_without_its_filtered_events_a_filtered_sample_is_lost():
    """C2 holds because `filtered` accounts for the samples: drop those lines and they are stranded."""
    events = [e for e in _clean_ledger() if e["ev"] != "filtered"]
    report = audit(events)
    assert report.stranded > 0 and report.c2_violations and not report.ok


@pytest.mark.parametrize("mode", ["dora", "sync"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_restore_keeps_the_filtered_groups_accounted_and_the_counters(tmp_path, mode, seed):
    """Snapshot after a publish, let the doomed process go on (its filtered events are voided),
    restore on the same ledger file, finish: every group is consumed or filtered exactly once."""
    path = str(tmp_path / "ledger.jsonl")
    ledger = Ledger(path)
    coord, workers = make(mode, ledger, seed=seed)
    coord.start()
    rng = random.Random(seed)
    version = drive(coord, workers, 0, 2, rng)
    state = json.loads(json.dumps(coord.snapshot()))
    saved = state["stats"]

    class Crash(Exception):
        pass

    def lost_work(ticks):
        if ticks > 40:
            raise Crash

    with pytest.raises(Crash):
        drive(coord, workers, version, 10, rng, on_tick=lost_work)
    ledger.close()
    ledger2 = Ledger(path)
    coord2, workers2 = make(mode, ledger2, seed=seed, initial_version=version)
    coord2.restore(state)
    assert coord2.stats.filtered_groups == saved["filtered_groups"] > 0
    assert coord2._filter_budget.since_take == state["filtered_since_take"]
    coord2.start()
    batches = []
    drive(coord2, workers2, version, 5, random.Random(seed + 1), batches)
    ledger2.close()
    assert all(informative(g.group_id) for batch in batches for g in batch)
    report = audit(read_ledger(path))
    assert report.ok and report.resumes == 1, report.summary()
    assert report.consumed == 5 * TBS
    assert report.filtered_groups == coord2.stats.filtered_groups


def test_the_audit_cli_reports_the_filtered_groups_and_fails_a_tampered_ledger(tmp_path, capsys):
    from dora_jax.cli.audit import main

    events = _clean_ledger()
    filtered = sum(e["ev"] == "filtered" for e in events)
    scored = sum(e["ev"] == "score" for e in events)
    path = tmp_path / "ledger.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    assert main(["audit", str(path)]) == 0
    assert f"{filtered} of {scored} completed groups filtered ({G * filtered} samples)" in capsys.readouterr().out
    gone = next(e for e in events if e["ev"] == "filtered")
    consume = next(e for e in events if e["ev"] == "consume")
    events.append(dict(consume, traj=gone["trajs"][0], group=gone["group"], version=gone["version"]))
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    assert main(["audit", str(path)]) == 1
    assert "'exactly_once': 1" in capsys.readouterr().out


def test_a_failed_grade_counts_as_the_trainer_scores_it():
    """task.reward_on_error=0 (the default): a group of three right answers and one whose grading
    timed out has reward variance for the trainer (1, 1, 1, 0), so the filter keeps it and the
    ledger's score says what the trainer trains on; with "mask" (None) the failed grade does not
    count and the group, all right, is filtered. A rejected request never counts."""
    from dora_jax.core.records import FinishReason, Group, ScoredTrajectory, Trajectory

    def sample(i, reward, error=None, reason=FinishReason.EOS):
        traj = Trajectory(
            traj_id=f"g/{i}",
            group_id="g",
            prompt_id="p",
            prompt_ids=(1,),
            response_ids=(2,),
            logprobs=(-0.5,),
            version=0,
            versions_seen=(0,),
            finish_reason=reason,
        )
        return ScoredTrajectory(traj, reward, error)

    group = Group("g", 0, (sample(0, 1.0), sample(1, 1.0), sample(2, 1.0), sample(3, 0.0, "timeout")))
    assert dynamic_sampling.why_filtered(group, 0.0) is None
    assert dynamic_sampling.score_event(group, 0.0)["rewards"] == [1.0, 1.0, 1.0, 0.0]
    assert dynamic_sampling.score_event(group, 0.0)["valid"] == [True, True, True, True]
    assert dynamic_sampling.why_filtered(group, None) == dynamic_sampling.ALL_REWARDS_EQUAL
    assert dynamic_sampling.score_event(group, None)["valid"] == [True, True, True, False]
    rejected = Group(
        "g", 0, (sample(0, 1.0), sample(1, 0.0, "rejected", FinishReason.REJECTED), sample(2, 1.0), sample(3, 1.0))
    )
    assert dynamic_sampling.why_filtered(rejected, 0.0) == dynamic_sampling.ALL_REWARDS_EQUAL
