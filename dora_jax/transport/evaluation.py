"""The trainer role's evaluation port when the coordinator is another process (`Evaluate`).

`RemoteEvaluation.request_eval` stands where the embedded run calls `Coordinator.request_eval`
(dora_jax.runtime.evaluator.Evaluator takes either): it asks the coordinator for a round of a
version at once (so the round starts before the trainer's next publish, the only version the
coordinator accepts) and returns a Future that one poller thread resolves when the round is done.
The coordinator evaluates its own held-out prompts, built from the same config: the trainer's
copy only turns the responses' prompt ids back into text. The result has the embedded run's
shape: the round's summary and `responses`, (Trajectory, reward, error) per response, plus the
leak counts that only the coordinator (where training prompts are drawn) knows.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from concurrent.futures import Future

from dora_jax.transport import codec
from dora_jax.transport import dora_pb2 as pb
from dora_jax.transport.client import CoordinatorUnreachable

POLL_S = 2.0  # the long-poll window of one Evaluate call once the round is started


class RemoteEvaluation:
    def __init__(self, client, poll_s: float = POLL_S):
        self._client, self._poll_s = client, poll_s
        self._cond = threading.Condition()
        self._pending: dict[int, tuple[int, Future]] = {}  # version -> (samples, future), oldest first
        self._closed = False
        self._thread = threading.Thread(target=self._poll, name="evaluation-poll", daemon=True)
        self._thread.start()

    def request_eval(self, version: int, step: int, prompts: Sequence, samples: int) -> Future:
        """Starts the round of `version` at the coordinator; `step` is the version (as the embedded
        run asks) and `prompts` the trainer's copy of the held-out set, which the coordinator does
        not take: it evaluates its own."""
        del step, prompts
        future: Future = Future()
        try:
            reply = self._call(version, samples, 0.0)
        except Exception as err:  # the Evaluator logs it; the run goes on
            future.set_exception(err)
            return future
        if reply.ready:
            future.set_result(_result(reply))
            return future
        with self._cond:
            self._pending[version] = (samples, future)
            self._cond.notify_all()
        return future

    def close(self) -> None:
        """Stops polling; rounds not finished stay unresolved (the Evaluator says how many)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=self._poll_s + self._client.timing.call_timeout_s)

    def _call(self, version: int, samples: int, wait_s: float) -> pb.EvaluateReply:
        request = pb.EvaluateRequest(session=self._client.session, version=version, samples=samples, wait_s=wait_s)
        return self._client.call(
            "Evaluate",
            lambda t: self._client.stub.Evaluate(request, timeout=t),
            timeout_s=wait_s + self._client.timing.call_timeout_s,
        )

    def _poll(self) -> None:
        """Long-polls the oldest unfinished round (rounds finish about in the order asked)."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._pending)
                if self._closed:
                    return
                version = next(iter(self._pending))
                samples, future = self._pending[version]
            try:
                reply = self._call(version, samples, self._poll_s)
            except CoordinatorUnreachable as err:  # every round is lost with the coordinator
                self._fail_all(err)
                continue
            except Exception as err:  # this round is lost; the others may still come
                reply = err
            if isinstance(reply, Exception) or reply.ready:
                with self._cond:
                    self._pending.pop(version, None)
                if isinstance(reply, Exception):
                    future.set_exception(reply)
                else:
                    future.set_result(_result(reply))

    def _fail_all(self, err: Exception) -> None:
        with self._cond:
            pending, self._pending = self._pending, {}
        for _, future in pending.values():
            future.set_exception(err)


def _result(reply: pb.EvaluateReply) -> dict:
    """The reply as `Coordinator.request_eval`'s result."""
    result = json.loads(reply.summary_json)
    result["responses"] = [
        (
            codec.trajectory_from_proto(s.trajectory),
            float(s.reward),
            s.reward_error if s.has_reward_error else None,
        )
        for s in reply.responses
    ]
    return result
