"""Evaluation during training, the runner's side: when to ask, and where the answers go.

At version 0, every `eval.every_steps` steps and at the last step, the newest version is evaluated
on the held-out prompts (dora_jax.tasks.eval_set) through the rollout slices
(`Coordinator.request_eval`); the trainer does not wait for it. Each finished round becomes a
row of metrics.jsonl, `{"step": version, "eval/reward_greedy": ..., "eval/pass@k": ...,
"eval/response_len_mean": ..., "eval/wall_s": ..., "eval/leaked_train_prompts": ...}`, and
its responses, decoded, lines of WORKDIR/eval_samples.jsonl
(`{"step", "prompt_id", "prompt", "response", "reward", "greedy", "error"}`).

The same class serves every placement: `coordinator` is the in-process `Coordinator` (the embedded
run) or the trainer role's `RemoteEvaluation` (dora_jax.transport.evaluation: the same request
over gRPC, its result in the same shape). Where the training prompts are drawn in another process
(`leaks` None), the round's result carries the leak counts.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time
from collections.abc import Callable, Sequence

from dora_jax.coordinator.evaluation import GREEDY
from dora_jax.core import fs
from dora_jax.runtime.metrics import MetricsWriter
from dora_jax.runtime.run_config import EvalSpec
from dora_jax.tasks.eval_set import LeakCounter
from dora_jax.tasks.prompt import Prompt

log = logging.getLogger(__name__)


class Evaluator:
    def __init__(
        self,
        spec: EvalSpec,
        num_steps: int,
        prompts: Sequence[Prompt],
        leaks: LeakCounter | None,
        coordinator,
        decode: Callable[[Sequence[int]], str],
        workdir: str,
        writer: MetricsWriter | None,
    ):
        self.spec, self.num_steps, self.prompts = spec, num_steps, list(prompts)
        self.leaks = leaks  # counted where the training prompts are drawn (the runner's next_prompt)
        self._coord, self._decode, self._writer = coordinator, decode, writer
        self._samples_path = fs.join(workdir, "eval_samples.jsonl")
        self._by_id = {p.prompt_id: p for p in self.prompts}
        self._pending: dict[concurrent.futures.Future, tuple[int, float]] = {}
        self.results: list[dict] = []

    def maybe_request(self, version: int) -> None:
        """Asks for a round if `version` is due (call it right after the version's publish)."""
        if not self.spec.due(version, self.num_steps):
            return
        pairs = [(p.prompt_id, p.prompt_ids) for p in self.prompts]
        future = self._coord.request_eval(version, version, pairs, self.spec.samples)
        self._pending[future] = (version, time.perf_counter())

    def harvest(self, timeout: float | None = 0.0) -> list[dict]:
        """Writes the rounds that are done (waiting up to `timeout` s for all; None: forever)."""
        if not self._pending:
            return []
        done, _ = concurrent.futures.wait(list(self._pending), timeout=timeout)
        rows = []
        for future in sorted(done, key=lambda f: self._pending[f][0]):
            version, asked = self._pending.pop(future)
            try:
                result = future.result()
            except Exception as err:  # the run goes on without this round
                log.warning("evaluation of version %d failed: %s", version, err)
                continue
            rows.append(self._record(result, time.perf_counter() - asked))
        return rows

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _record(self, result: dict, wall_s: float) -> dict:
        responses = result.pop("responses")
        row = {k: v for k, v in result.items() if k.startswith("eval/")}
        row["eval/wall_s"] = wall_s
        if self.leaks is not None:
            row["eval/leaked_train_prompts"] = self.leaks.leaked
            row["eval/prompts_seen_in_training"] = self.leaks.eval_prompts_seen_in_training
        step = int(result["step"])
        if self._writer is not None:
            self._writer.write(step, row)
        with fs.open(self._samples_path, "a") as f:
            for traj, reward, error in responses:
                prompt = self._by_id[traj.prompt_id]
                line = {
                    "step": step,
                    "prompt_id": traj.prompt_id,
                    "prompt": prompt.text,
                    "response": self._decode(traj.response_ids),
                    "reward": reward,
                    "greedy": traj.traj_id.rsplit("/", 1)[1] == GREEDY,
                    "error": error,
                }
                f.write(json.dumps(line) + "\n")
        self.results.append({"step": step, **row})
        return row
