"""Evaluation rounds in the coordinator: through the slices at one version, never trained on,
counted apart by the auditor, and summarised with numbers recomputed here from the ledger."""

import random
from concurrent.futures import Future

import pytest

from dora_jax.coordinator.audit import audit
from dora_jax.coordinator.evaluation import EvalRound
from dora_jax.coordinator.ledger import Ledger
from dora_jax.core.records import FinishReason, Trajectory
from tests.coordinator.fakes import make_coordinator, tick_some

EVAL_PROMPTS = [(f"eval/q{i}", (1, 2, 3, i % 5)) for i in range(6)]
SAMPLES = 3


def drive(mode, *, steps=6, eval_at=(0, 3, 6), kill_slice_at_eval=None, seed=0):
    """Trains `steps` steps on fake slices, asking for an evaluation right after the publish of
    each version in `eval_at`; returns (coord, ledger, {version: future})."""
    ledger = Ledger(None)
    coord, workers = make_coordinator(mode, ledger, seed=seed)
    coord.start()
    futures = {}

    def ask(version):
        if version in eval_at:
            futures[version] = coord.request_eval(version, version, EVAL_PROMPTS, SAMPLES)
            coord.process()
            if kill_slice_at_eval == version:  # the slice holding most of the round
                sid = max(coord.slice_trajs, key=lambda s: sum(t.startswith("e") for t in coord.slice_trajs[s]))
                assert any(t.startswith("e") for t in coord.slice_trajs[sid])
                workers[sid].dead = True
                coord.post_slice_failed(sid, "killed during the evaluation")

    ask(0)
    rng = random.Random(seed)
    version, ticks = 0, 0
    while version < steps or not all(f.done() for f in futures.values()):
        ticks += 1
        assert ticks < 20000, "no progress"
        tick_some(workers, rng)
        coord.process()
        if version < steps and coord.try_take_batch(version) is not None:
            version += 1
            coord.post_published(version)
            coord.process()
            ask(version)
    return coord, ledger, futures


def expected_summary(events, round_id):
    """The round's numbers recomputed from its finish events (InstantScorer: reward = tokens % 2)."""
    greedy, sampled = [], {}
    for e in events:
        if e["ev"] == "finish" and e["traj"].startswith(round_id + "/"):
            _, prompt, index = e["traj"].split("/")
            reward = e["tokens"] % 2
            if index == "g":
                greedy.append((reward, e["tokens"]))
            else:
                sampled.setdefault(prompt, []).append(reward)
    return {
        "eval/reward_greedy": sum(r for r, _ in greedy) / len(greedy),
        "eval/response_len_mean": sum(n for _, n in greedy) / len(greedy),
        f"eval/pass@{SAMPLES}": sum(any(r >= 1 for r in rs) for rs in sampled.values()) / len(sampled),
    }


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "dora"])
def test_evaluation_runs_through_the_slices_at_one_version_and_is_never_trained_on(mode):
    coord, ledger, futures = drive(mode)
    events = ledger.memory
    report = audit(events)
    assert report.ok, report.summary()
    per_round = len(EVAL_PROMPTS) * (1 + SAMPLES)
    assert report.eval_dispatched == report.eval_finished == 3 * per_round
    assert report.eval_unfinished_at_end == 0
    assert coord.stats.eval_dispatched == 3 * per_round and coord.stats.evals == 3
    assert report.consumed == 6 * 8  # training samples only
    dispatches = {e["traj"]: e for e in events if e["ev"] == "dispatch"}
    for version, future in futures.items():
        result = future.result()
        assert result["step"] == result["version"] == version
        round_id = next(e["round"] for e in events if e["ev"] == "eval_start" and e["version"] == version)
        mine = [e for e in events if e["ev"] == "finish" and e["traj"].startswith(round_id + "/")]
        assert len(mine) == per_round
        assert all(e["eval"] and e["version"] == version and e["versions_seen"] == [version] for e in mine)  # C1
        assert all(dispatches[e["traj"]]["eval"] for e in mine)
        for key, value in expected_summary(events, round_id).items():
            assert result[key] == pytest.approx(value)
        assert len(result["responses"]) == per_round
        logged = next(e for e in events if e["ev"] == "eval" and e["round"] == round_id)
        assert logged["eval/reward_greedy"] == result["eval/reward_greedy"]
    consumed = {e["traj"] for e in events if e["ev"] == "consume"}
    assert not any(t.startswith("e") for t in consumed)


def test_a_slice_dying_mid_evaluation_re_dispatches_its_requests_under_the_same_version():
    coord, ledger, futures = drive("dora", kill_slice_at_eval=3)
    report = audit(ledger.memory)
    assert report.ok, report.summary()
    assert all(f.result()["prompts"] == len(EVAL_PROMPTS) for f in futures.values())
    first = {}
    for e in ledger.memory:
        if e["ev"] == "dispatch" and e.get("eval"):
            first.setdefault(e["traj"], e["version"])
    redispatched = [e for e in ledger.memory if e["ev"] == "dispatch" and e.get("eval") and e.get("redispatch")]
    assert redispatched and all(e["version"] == first[e["traj"]] for e in redispatched)


def test_evaluation_requests_do_not_shrink_the_training_supply():
    """RBS counts training samples only: an evaluation round adds work, it does not displace it."""
    coord, _ = make_coordinator("dora", Ledger(None))
    coord.start()
    before = len(coord.requests) + len(coord.backlog)
    coord.request_eval(0, 0, EVAL_PROMPTS, SAMPLES)
    coord.process()
    in_flight = len(coord.requests) + len(coord.backlog)
    assert before == coord.config.rollout_batch_size
    assert in_flight == before + len(EVAL_PROMPTS) * (1 + SAMPLES)
    snapshot = coord.snapshot()  # a round in flight is not checkpointed
    assert not [r for r in snapshot["dispatched"] + snapshot["backlog"] if r["traj_id"].startswith("e0/")]


def test_an_evaluation_of_a_future_version_is_refused():
    coord, _ = make_coordinator("dora", Ledger(None))
    coord.start()
    future = coord.request_eval(5, 5, EVAL_PROMPTS, SAMPLES)
    coord.process()
    with pytest.raises(ValueError, match="evaluation of version 5: newest is 0"):
        future.result()


def test_the_auditor_flags_a_trained_evaluation_and_does_not_count_an_unfinished_one_as_lost():
    base = [
        {"ev": "run", "mode": "dora", "k_max": 2},
        {"ev": "load_version", "slice": 0, "version": 0},
        {"ev": "dispatch", "traj": "e0/0/g", "version": 0, "slice": 0, "eval": True},
        {"ev": "dispatch", "traj": "e0/0/0", "version": 0, "slice": 0, "eval": True},
        {"ev": "dispatch", "traj": "g0/0", "version": 0, "slice": 0},
        {"ev": "finish", "traj": "e0/0/g", "version": 0, "versions_seen": [0]},
        {"ev": "finish", "traj": "g0/0", "version": 0, "versions_seen": [0]},
        {"ev": "consume", "traj": "g0/0", "group": "g0", "version": 0, "step": 0, "trainer_version": 0},
        {"ev": "publish", "version": 1},
    ]
    for step in range(1, 6):  # the trainer moves far past version 0 + K
        base.append({"ev": "publish", "version": step + 1})
    clean = audit(base)
    assert clean.ok and clean.eval_unfinished_at_end == 1 and clean.stranded == 0
    assert clean.eval_dispatched == 2 and clean.eval_finished == 1 and clean.dispatched == 1
    trained = audit(
        base + [{"ev": "consume", "traj": "e0/0/g", "group": "e0/0", "version": 0, "step": 1, "trainer_version": 1}]
    )
    assert trained.exactly_once_violations == ["e0/0/g: an evaluation trajectory was trained on"]


def test_pass_at_k_and_greedy_reward_of_a_round():
    run = EvalRound("e0", 4, 4, num_prompts=2, samples=2, result=Future())

    def traj(traj_id, tokens):
        return Trajectory(
            traj_id, traj_id.rsplit("/", 1)[0], "p", (1,), (5,) * tokens, (0.0,) * tokens, 4, (4,), FinishReason.STOP
        )

    for traj_id, tokens, reward in [
        ("e0/0/g", 3, 1.0),
        ("e0/0/0", 2, 0.0),
        ("e0/0/1", 4, 1.0),
        ("e0/1/g", 5, 0.0),
        ("e0/1/0", 1, 0.0),
        ("e0/1/1", 1, 0.5),  # partial credit is not a pass
    ]:
        assert not run.done
        run.add(traj(traj_id, tokens), reward, None)
    assert run.done
    summary = run.summary()
    assert summary["eval/reward_greedy"] == 0.5
    assert summary["eval/pass@2"] == 0.5
    assert summary["eval/response_len_mean"] == 4.0
    assert summary["eval/reward_mean"] == pytest.approx(1.5 / 4)


def test_partial_rollout_continues_evaluation_requests_on_the_new_version_and_says_so():
    coord, ledger, futures = drive("partial_rollout")
    assert audit(ledger.memory).ok
    for version, future in futures.items():
        result = future.result()
        round_id = next(e["round"] for e in ledger.memory if e["ev"] == "eval_start" and e["version"] == version)
        mixed = [
            e
            for e in ledger.memory
            if e["ev"] == "finish" and e["traj"].startswith(round_id + "/") and e["versions_seen"] != [version]
        ]
        assert result["eval/mixed_versions"] == len(mixed)
    assert sum(f.result()["eval/mixed_versions"] for f in futures.values()) > 0


def test_a_resumed_run_evaluates_under_new_round_ids_and_audits_clean(tmp_path):
    """A round in flight at the checkpoint is lost with the process (not saved, not a C2 loss);
    the resumed coordinator's next round must not reuse its id, or the old round's dispatches and
    the new round's finishes look like one trajectory generated twice under two versions."""
    import json

    from dora_jax.coordinator.ledger import read_ledger

    path = str(tmp_path / "ledger.jsonl")
    ledger = Ledger(path)
    coord, workers = make_coordinator("dora", ledger)
    coord.start()
    rng = random.Random(0)
    first = coord.request_eval(0, 0, EVAL_PROMPTS, SAMPLES)  # e0: finishes before the checkpoint
    version = _train_until(coord, workers, rng, 0, 2, first)
    assert coord.stats.evals == 1
    coord.request_eval(version, version, EVAL_PROMPTS, SAMPLES)  # e1: in flight at the checkpoint
    coord.process()
    state = json.loads(json.dumps(coord.snapshot()))
    ledger.close()

    ledger2 = Ledger(path)
    coord2, workers2 = make_coordinator("dora", ledger2, initial_version=version)
    coord2.restore(state)
    coord2.start()
    future = coord2.request_eval(version, version, EVAL_PROMPTS, SAMPLES)
    _train_until(coord2, workers2, rng, version, 4, future)
    ledger2.close()
    events = list(read_ledger(path))
    assert [e["round"] for e in events if e["ev"] == "eval_start"] == ["e0", "e1", "e2"]
    report = audit(events)
    assert report.ok, report.summary()
    assert not report.c1_violations and not report.exactly_once_violations
    per_round = len(EVAL_PROMPTS) * (1 + SAMPLES)
    assert report.eval_finished == 2 * per_round and report.eval_unfinished_at_end == per_round
    assert [r["round"] for r in report.evaluations] == ["e0", "e2"]
    assert report.consumed == 4 * 8


def _train_until(coord, workers, rng, version, steps, future):
    """Ticks and trains up to version `steps`, and on until `future` (an evaluation) is done."""
    while version < steps or not future.done():
        tick_some(workers, rng)
        coord.process()
        if version < steps and coord.try_take_batch(version) is not None:
            version += 1
            coord.post_published(version)
            coord.process()
    return version
