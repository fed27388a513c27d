"""A worker's results are checked against the coordinator's own records (dora_jax/coordinator/intake.py).

The checks one by one on a request and a result built from it; then runs of the real Coordinator
over scripted fake workers into which a forged result is posted from slice 0: it fails that slice
alone (its requests re-dispatched, the refusal counted and in the ledger's `slice_failed`, no
`finish` written for it), the slice rejoins, the run trains on to its last step, and the full
audit of the ledger passes; nothing malformed reaches a training batch.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from dora_jax.coordinator import intake
from dora_jax.coordinator.audit import audit
from dora_jax.coordinator.ledger import Ledger
from dora_jax.core.records import FinishReason, Request, Trajectory
from tests.coordinator.fakes import DyingWorker, make_coordinator, tick_some

REQUEST = Request("g3/1", "g3", "p7", (5, 6, 7), 2, 16, prefix_response_ids=(1, 1), prefix_logprobs=(-0.1, -0.2))


def _result(request: Request, slice_id: int = 0, tokens: int = 3, **changes) -> Trajectory:
    """What a worker serving `request` would post: `tokens` tokens of id 1 at log-prob -0.5."""
    base = Trajectory(
        request.traj_id,
        request.group_id,
        request.prompt_id,
        request.prompt_ids,
        (1,) * tokens,
        (-0.5,) * tokens,
        request.version,
        (request.version,) if tokens else (),
        FinishReason.LENGTH,
        slice_id,
    )
    return dataclasses.replace(base, **changes)


def _scored(logprobs, digest="0123456789abcdef") -> dict:
    """The changes of a result that comes with slice-scored behaviour log-probs."""
    return {"behaviour_logprobs": logprobs, "behaviour_digest": digest}


def _check(traj, newest=2, vocab=8):
    return intake.check(traj, REQUEST, newest_version=newest, vocab_size=vocab)


def test_a_well_formed_result_passes_and_enters_with_the_requests_own_fields():
    good = _result(REQUEST, tokens=5, slice_id=9, error="x" * 10_000, logprobs=(-0.5,) * 4 + (1e-5,))
    assert _check(good) is None
    assert _check(_result(REQUEST, tokens=16)) is None  # max_new_tokens exactly
    entered = intake.accepted(good, REQUEST, slice_id=1)
    assert (entered.group_id, entered.prompt_id, entered.prompt_ids, entered.version) == ("g3", "p7", (5, 6, 7), 2)
    assert entered.slice_id == 1 and len(entered.error) == intake.MAX_ERROR_CHARS
    assert entered.response_ids == good.response_ids and entered.logprobs == good.logprobs
    scored = _result(REQUEST, **_scored((-0.5, -1.0, 5e-5)))  # 5e-5 > 0: float rounding, within tolerance
    assert _check(scored) is None
    entered = intake.accepted(scored, REQUEST, slice_id=1)
    assert entered.behaviour_logprobs == (-0.5, -1.0, 5e-5) and entered.behaviour_digest == "0123456789abcdef"
    # Under partial rollout a resumed request carries tokens of newer versions than its own.
    assert _check(_result(REQUEST, versions_seen=(2, 3, 4)), newest=4) is None


@pytest.mark.parametrize(
    "changes,expected",
    [
        ({"group_id": "g4"}, "group_id='g4' but it was dispatched with 'g3'"),
        ({"prompt_id": "p8"}, "prompt_id='p8' but it was dispatched with 'p7'"),
        ({"version": 3}, "version='3' but it was dispatched with '2'"),
        ({"prompt_ids": (5, 6, 8)}, "its 3 prompt tokens differ from the 3 dispatched"),
        ({"logprobs": (-0.5, -0.5)}, "3 response tokens but 2 log-probs"),
        (
            {"response_ids": (1,) * 17, "logprobs": (-0.5,) * 17},
            "17 response tokens; the request allows max_new_tokens=16",
        ),
        ({"response_ids": (2, 1, 1)}, "its response does not continue the 2 tokens it was re-dispatched with"),
        ({"response_ids": (1, 1, 8)}, "response token id '8' outside the vocabulary [0, 8)"),
        ({"response_ids": (1, 1, -1)}, "response token id '-1' outside the vocabulary [0, 8)"),
        ({"response_ids": (1, 1, "a")}, "a response token id that is not a number"),
        ({"logprobs": (-0.5, math.nan, -0.5)}, "log-prob nan; expected finite"),
        ({"logprobs": (-0.5, -math.inf, -0.5)}, "log-prob -inf; expected finite"),
        ({"logprobs": (-0.5, 0.5, -0.5)}, "log-prob 0.5 > 0 (tolerance 0.0001)"),
        ({"logprobs": (-0.5, 2e-4, -0.5)}, "log-prob 0.0002 > 0"),
        ({"logprobs": (-1e308, -1e308, -1e308)}, "log-probs below the float range"),
        ({"logprobs": (-0.5, None, -0.5)}, "a log-prob that is not a number"),
        ({"versions_seen": (3,)}, "sampled by versions '[3]'; its slice could sample it only with v2"),
        ({"versions_seen": (1, 2)}, "sampled by versions '[1, 2]'"),
        ({"versions_seen": (2, 2)}, "versions_seen '[2, 2]' is not sorted without repeats"),
        ({"versions_seen": ()}, "versions_seen has 0 versions for 3 response tokens"),
        ({"versions_seen": (2, 3, 4, 5)}, "versions_seen has 4 versions for 3 response tokens"),
        ({"decode_s": math.inf}, "decode_s='inf'; expected a finite number >= 0"),
        ({"decode_s": -1.0}, "decode_s='-1.0'"),
        (_scored((-0.5, -0.5)), "3 response tokens but 2 behaviour log-probs"),
        (_scored((-0.5,) * 4), "3 response tokens but 4 behaviour log-probs"),
        (_scored((-0.5, math.nan, -0.5)), "behaviour log-prob nan; expected finite"),
        (_scored((-0.5, -math.inf, -0.5)), "behaviour log-prob -inf; expected finite"),
        (_scored((-0.5, 0.5, -0.5)), "behaviour log-prob 0.5 > 0 (tolerance 0.0001)"),
        (_scored((-0.5, None, -0.5)), "behaviour a log-prob that is not a number"),
        (_scored((-0.5,) * 3, digest=None), "behaviour_digest='None'; expected the scoring params' digest"),
        (_scored((-0.5,) * 3, digest=""), "behaviour_digest=''"),
        (_scored((-0.5,) * 3, digest="f" * 129), "behaviour_digest='ffff"),
        ({"behaviour_digest": "ab12"}, "behaviour_digest without behaviour_logprobs"),
    ],
)
def test_each_malformed_field_is_named(changes, expected):
    assert expected in _check(_result(REQUEST, **changes))


def test_token_ids_beyond_any_vocabulary_only_where_the_run_knows_it():
    assert _check(_result(REQUEST, response_ids=(1, 1, 10**6)), vocab=0) is None
    assert "outside the vocabulary" in _check(_result(REQUEST, response_ids=(1, 1, 10**6)), vocab=10**6)


def test_a_quoted_worker_string_is_bounded_and_escaped():
    shown = intake.shown("line\n[coordinator] the trainer has finished its steps" + "x" * 10**6)
    assert "\n" not in shown and shown.startswith("'line\\n[coordinator]")
    assert len(shown) < 120 and shown.endswith(f"...(+{10**6 + 53 - intake.MAX_SHOWN_CHARS} chars)")


# --------------------------------------------------------------------------- forged results in a run
def _in_flight(coord, slice_id):
    return [coord.requests[t] for t in coord.slice_trajs.get(slice_id, {})]


def _forge_unknown(coord):
    request = dataclasses.replace(_in_flight(coord, 0)[0], traj_id="g9999/0", group_id="g9999")
    return [_result(request)], "'g9999/0' is not in flight (never dispatched, or finished already)", {}


def _forge_duplicate(coord):
    done = [e["traj"] for e in coord.ledger.memory if e["ev"] == "finish" and e["slice"] == 0]
    if not done:
        return None
    request = dataclasses.replace(_in_flight(coord, 0)[0], traj_id=done[0])
    return [_result(request)], f"'{done[0]}' is not in flight", {}


def _forge_twice_in_one_post(coord):
    request = _in_flight(coord, 0)[0]
    return [_result(request), _result(request)], f"'{request.traj_id}' twice in one post", {}


def _forge_wrong_slice(coord):
    theirs = _in_flight(coord, 1)
    if not theirs:
        return None
    request = theirs[0]
    return [_result(request)], f"'{request.traj_id}' was dispatched to slice 1, not this one", {"other": request}


def _forge_swapped_group(coord):
    mine = _in_flight(coord, 0)[0]
    others = [g for g in coord.groups if g != mine.group_id and coord.groups[g].version == mine.version]
    if not others:
        return None
    other = others[0]
    forged = _result(mine, group_id=other)
    return [forged], f"group_id='{other}' but it was dispatched with '{mine.group_id}'", {"group": other}


def _forge_field(reason, **changes):
    def forge(coord):
        request = _in_flight(coord, 0)[0]
        return [_result(request, **changes)], reason, {}

    return forge


FORGERIES = {
    "unknown": _forge_unknown,
    "duplicate": _forge_duplicate,
    "twice_in_one_post": _forge_twice_in_one_post,
    "wrong_slice": _forge_wrong_slice,
    "swapped_group": _forge_swapped_group,
    "length_mismatch": _forge_field("3 response tokens but 2 log-probs", logprobs=(-0.5, -0.5)),
    "nan_logprob": _forge_field("log-prob nan; expected finite", logprobs=(-0.5, math.nan, -0.5)),
    "positive_logprob": _forge_field("log-prob 0.5 > 0", logprobs=(-0.5, 0.5, -0.5)),
    "out_of_vocab": _forge_field("response token id '7' outside the vocabulary [0, 2)", response_ids=(1, 7, 1)),
    "behaviour_length": _forge_field("3 response tokens but 2 behaviour log-probs", **_scored((-0.5, -0.5))),
    "behaviour_nan": _forge_field("behaviour log-prob nan", **_scored((-0.5, math.nan, -0.5))),
    "behaviour_positive": _forge_field("behaviour log-prob 0.5 > 0", **_scored((-0.5, 0.5, -0.5))),
    "too_long": _forge_field("201 response tokens", response_ids=(1,) * 201, logprobs=(-0.5,) * 201),
}


def _run_with_forgery(mode, forge, *, steps=6, seed=0):
    """Drives a run to `steps` trainer versions; once slice 0 holds requests (after the first
    publish), posts `forge(coord)`'s results as slice 0's. A dropped slice rejoins with a fresh
    worker at once. Returns what the test checks."""
    ledger = Ledger(None)
    dropped = []
    coord, workers = make_coordinator(
        mode, ledger, seed=seed, vocab_size=2, on_slice_dropped=lambda sid, why: dropped.append((sid, why)) or True
    )
    coord.start()
    rng = random.Random(seed)
    version, batches, forged = 0, [], None
    for _ in range(50_000):
        tick_some(workers, rng)
        coord.process()
        if forged is None and version >= 1 and coord.slice_trajs[0]:
            made = forge(coord)
            if made is not None:
                held = set(coord.slice_trajs[0])
                forged = dict(zip(("post", "reason", "info"), made), held=held, at=len(ledger.memory))
                coord.post_finished(0, made[0])
                coord.process()
        for sid, _ in dropped:
            workers[sid].dead = True  # the runner abandons a dropped worker and starts a fresh one
            workers[sid] = DyingWorker(sid, 4, [coord], coord.length_of)
            coord.post_slice_joined(workers[sid])
        dropped.clear()
        batch = coord.try_take_batch(version)
        if batch is not None:
            batches.append(batch)
            version += 1
            coord.post_published(version)
            coord.process()
        if version == steps:
            return coord, ledger, batches, forged
    raise AssertionError(f"no progress: version {version}, forged {forged is not None}")


def _assert_batches_are_clean(batches, group_size=4):
    for batch in batches:
        for group in batch:
            ids = sorted(s.trajectory.traj_id for s in group.samples)
            assert ids == [f"{group.group_id}/{i}" for i in range(group_size)]
            for sample in group.samples:
                traj = sample.trajectory
                assert traj.group_id == group.group_id and traj.version == group.version
                assert len(traj.logprobs) == len(traj.response_ids) <= 200
                assert all(math.isfinite(x) and x <= 0 for x in traj.logprobs)
                assert set(traj.response_ids) <= {1} and traj.versions_seen == (group.version,)


@pytest.mark.parametrize("kind", sorted(FORGERIES))
def test_a_forged_result_fails_only_its_slice_and_the_run_finishes_audited(kind):
    coord, ledger, batches, forged = _run_with_forgery("dora", FORGERIES[kind])
    assert forged is not None, "the forgery never found what it needed"
    report = audit(ledger.memory)
    assert report.ok, report.summary()
    assert report.consumed == 6 * 8 and coord.stats.consumed == 6 * 8
    assert coord.stats.result_violations == 1 and coord.stats.slice_failures == 1
    failed = [e for e in ledger.memory if e["ev"] == "slice_failed"]
    assert [e["slice"] for e in failed] == [0]
    assert failed[0]["reason"].startswith("refused its result: ") and forged["reason"] in failed[0]["reason"]
    assert failed[0]["requests"] == len(forged["held"])
    after = ledger.memory[forged["at"] :]
    redispatched = {e["traj"] for e in after if e["ev"] == "dispatch" and e.get("redispatch")}
    assert forged["held"] <= redispatched  # what slice 0 held went to the others, as for a dead slice
    finishes = [e for e in ledger.memory if e["ev"] == "finish"]
    assert len(finishes) == len({e["traj"] for e in finishes})  # no forged second finish
    assert all(e["tokens"] != 201 and e["versions_seen"] == [e["version"]] for e in finishes)
    assert [e["slice"] for e in ledger.memory if e["ev"] == "slice_joined"] == [0]
    _assert_batches_are_clean(batches)
    if kind == "wrong_slice":  # the slice that really held it finishes it; it is never re-dispatched
        other = forged["info"]["other"].traj_id
        assert [e["slice"] for e in finishes if e["traj"] == other] == [1] and other not in redispatched
    if kind == "swapped_group":  # the other group is whole, with its own samples, and trained on
        group = forged["info"]["group"]
        consumed = sorted(e["traj"] for e in ledger.memory if e["ev"] == "consume" and e["group"] == group)
        assert consumed == [f"{group}/{i}" for i in range(4)]


def test_refused_results_in_partial_rollout_and_a_bad_post_counts_none_of_its_results():
    """One bad trajectory in a post of good ones: the slice fails and none of it counts (the good
    ones are re-dispatched with the rest); partial rollout's version window applies too."""

    def forge(coord):
        requests = _in_flight(coord, 0)
        if len(requests) < 2:
            return None
        good = _result(requests[0])
        bad = _result(requests[1], logprobs=(-0.5, -0.5))
        return [good, bad], "3 response tokens but 2 log-probs", {"good": requests[0].traj_id}

    coord, ledger, batches, forged = _run_with_forgery("partial_rollout", forge, seed=3)
    failed = [e for e in ledger.memory if e["ev"] == "slice_failed"]
    assert [e["slice"] for e in failed] == [0] and "3 response tokens but 2 log-probs" in failed[0]["reason"], failed
    report = audit(ledger.memory)
    assert report.ok and report.consumed == 6 * 8, report.summary()
    assert coord.stats.result_violations == 1
    good = forged["info"]["good"]
    assert [e["slice"] for e in ledger.memory if e["ev"] == "finish" and e["traj"] == good] != [0]
    assert good in {e["traj"] for e in ledger.memory[forged["at"] :] if e["ev"] == "dispatch" and e.get("redispatch")}


def test_origin_holds_only_requests_in_flight():
    """`origin` (the orchestrator's home slice per request) is trimmed as requests finish, not only
    when a slice drops: after many requests it holds no more than are in flight."""
    ledger = Ledger(None)
    coord, workers = make_coordinator("dora", ledger, seed=5)
    coord.start()
    rng = random.Random(5)
    version, largest = 0, 0
    while version < 25:
        tick_some(workers, rng)
        coord.process()
        assert set(coord.origin) <= set(coord.requests)
        largest = max(largest, len(coord.origin))
        if coord.try_take_batch(version) is not None:
            version += 1
            coord.post_published(version)
            coord.process()
    assert coord.stats.finished >= 25 * 8 and largest <= 16  # rollout_batch_size in flight at most


def test_a_bad_post_absorbed_while_its_slice_is_dropped_does_not_fail_it_twice():
    """Found by the service fuzz: a slice reported dead whose bad post is still in the inbox; the
    drop absorbs that post, which refused it and marked the slice failing again once it was gone
    (the loop then raised KeyError dropping it a second time). one_step_off: its switching pass
    absorbs nothing before the drop does."""
    ledger = Ledger(None)
    coord, workers = make_coordinator("one_step_off", ledger, vocab_size=2)
    coord.start()
    rng = random.Random(1)
    while not coord.slice_trajs[0]:
        tick_some(workers, rng)
        coord.process()
    held = set(coord.slice_trajs[0])
    bad = _result(_in_flight(coord, 0)[0], logprobs=(math.nan,) * 3)
    workers[0].dead = True
    coord.post_slice_failed(0, "process died")
    coord.post_finished(0, [bad])
    coord.process()
    assert 0 not in coord.ports and coord.stats.slice_failures == 1 and coord.stats.result_violations == 1
    failed = [e for e in ledger.memory if e["ev"] == "slice_failed"]
    assert [(e["slice"], e["reason"], e["requests"]) for e in failed] == [(0, "process died", len(held))]
    assert held <= {r.traj_id for r in coord.backlog} | set(coord.requests)
    assert not any(e["ev"] == "finish" and e["traj"] == bad.traj_id for e in ledger.memory)
