"""`Evaluate` through the real service and the real Coordinator (fake workers on the real
protocol, tests/transport/remote_fakes.py): the trainer's `RemoteEvaluation` gets the round the
coordinator evaluated on its own held-out prompts, in the shape `Coordinator.request_eval`
gives the embedded run; a version the trainer has not just published, a sample count over the
config's, a poll that changes the sample count, a run that evaluates nothing and a session that
is not the trainer's are refused with the reason, and the coordinator serves on."""

from __future__ import annotations

import json
import math
import time

import pytest

from dora_jax.coordinator.audit import audit
from dora_jax.coordinator.evaluation import GREEDY
from dora_jax.transport import dora_pb2 as pb
from dora_jax.transport.client import Refused, SessionLost
from dora_jax.transport.evaluation import RemoteEvaluation
from dora_jax.transport.service import MAX_WAIT_S, HeldOut
from tests.transport.remote_fakes import RemoteRun

PROMPTS = (("eval/0", (1, 2)), ("eval/1", (1, 2, 3)), ("eval/2", (2,)))
LEAKS = {"eval/leaked_train_prompts": 5, "eval/prompts_seen_in_training": 2}


def _held_out(max_samples=3) -> HeldOut:
    return HeldOut(PROMPTS, max_samples, lambda: dict(LEAKS))


def _evaluate(run, version, samples, wait_s=0.0, session=None) -> pb.EvaluateReply:
    request = pb.EvaluateRequest(
        session=run.trainer.session if session is None else session, version=version, samples=samples, wait_s=wait_s
    )
    return run.trainer.call("Evaluate", lambda t: run.trainer.stub.Evaluate(request, timeout=t))


def test_a_round_over_grpc_is_the_round_the_coordinator_evaluated():
    run = RemoteRun(slices=2, held_out=_held_out())
    evaluation = RemoteEvaluation(run.trainer, poll_s=0.2)
    try:
        run.train_to(2)
        future = evaluation.request_eval(2, 2, [], 2)
        result = future.result(timeout=60)
        rounds = [e for e in run.ledger.memory if e["ev"] == "eval"]
        assert len(rounds) == 1 and rounds[0]["version"] == 2 and rounds[0]["prompts"] == 3
        for key in ("step", "version", "prompts", "eval/reward_greedy", "eval/pass@2", "eval/reward_mean"):
            assert result[key] == rounds[0][key], key
        assert {k: result[k] for k in LEAKS} == LEAKS  # the counts only the coordinator knows
        responses = result["responses"]
        assert len(responses) == 3 * (1 + 2)
        assert sorted({t.prompt_id for t, _, _ in responses}) == ["eval/0", "eval/1", "eval/2"]
        assert all(t.version == 2 and set(t.versions_seen) <= {2} for t, _, _ in responses)
        greedy = [t for t, _, _ in responses if t.traj_id.rsplit("/", 1)[1] == GREEDY]
        assert len(greedy) == 3 and result["eval/response_len_mean"] == sum(t.num_tokens for t in greedy) / 3
        assert all(r == len(t.response_ids) % 2 and e is None for t, r, e in responses)  # InstantScorer's
        # A poll of a finished round (a retry whose reply was lost) answers it again, no new round.
        again = _evaluate(run, 2, 2)
        assert again.ready and len(again.responses) == 9
        assert len([e for e in run.ledger.memory if e["ev"] == "eval_start"]) == 1
        run.train_to(4)  # evaluation requests are never consumed; the audit holds
        report = audit(run.ledger.memory)
        assert report.ok and report.consumed == 4 * 8, report.summary()
    finally:
        evaluation.close()
        run.close()


def test_evaluate_refuses_what_the_coordinator_cannot_check_and_serves_on():
    run = RemoteRun(slices=2, held_out=_held_out(max_samples=3))
    try:
        run.train_to(2)
        refusals = {
            "not published yet": ((3, 1), "version 3 is not the newest version the trainer published"),
            "an older version": ((1, 1), "version 1 is not the newest version the trainer published"),
            "negative": ((-(2**63), 1), "is not the newest version"),
            "too many samples": ((2, 4), "samples=4; expected 0..3 (eval.samples)"),
            "negative samples": ((2, -1), "samples=-1; expected 0..3"),
        }
        for case, ((version, samples), reason) in refusals.items():
            with pytest.raises(Refused, match="refused Evaluate") as err:
                _evaluate(run, version, samples)
            assert reason in str(err.value), case
        with pytest.raises(SessionLost):
            _evaluate(run, 2, 1, session="not a session")
        # NaN and huge windows are bounded: the call returns (the round may not be done yet).
        t0 = time.monotonic()
        assert _evaluate(run, 2, 1, wait_s=math.nan).ready in (True, False)
        assert time.monotonic() - t0 < MAX_WAIT_S
        with pytest.raises(Refused, match="asked with samples=1, not 2"):
            _evaluate(run, 2, 2)
        reply = _evaluate(run, 2, 1, wait_s=30.0)
        assert reply.ready and len(reply.responses) == 3 * 2
        assert json.loads(reply.summary_json)["eval/pass@1"] is not None
        run.train_to(3)
        assert not run.loop_error
        assert len([e for e in run.ledger.memory if e["ev"] == "eval_start"]) == 1
        assert audit(run.ledger.memory).ok
    finally:
        run.close()


def test_a_run_without_held_out_prompts_refuses_every_round():
    run = RemoteRun(slices=2)
    try:
        run.train_to(1)
        with pytest.raises(Refused, match=r"evaluates nothing \(eval.every_steps is 0"):
            _evaluate(run, 1, 1)
        future = RemoteEvaluation(run.trainer).request_eval(1, 1, [], 1)
        with pytest.raises(Refused):
            future.result(timeout=5)
        run.train_to(2)
        assert not run.loop_error
    finally:
        run.close()
