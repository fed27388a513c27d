"""What a run checkpoint holds beside the arrays, and how a run comes back from it; shared by the
embedded run (dora_jax.runtime.runner) and the trainer and coordinator role processes.

A checkpoint's `meta` (dora_jax.runtime.checkpoint):
  coordinator      `Coordinator.snapshot()` taken once the trainer's version was applied; its
                   `extra` holds the prompt source's position
  trainer_version  the version the trainer state belongs to
  versions         the older versions something unconsumed still needs (stored beside `trainer`)
  prompts          the prompts still referred to (in-flight requests, trajectories awaiting a
                   reward), so that their rewards can be computed after the restart
  fingerprint      what a resumed run may not change (`check_resumable`)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence

from dora_jax import models
from dora_jax.core import fs
from dora_jax.tasks.prompt import Prompt


def fingerprint(config, setup) -> dict:
    """What a resumed run may not change (`config` a RunConfig, `setup` its build.Setup)."""
    model = {
        k: str(v) for k, v in dataclasses.asdict(setup.model_config).items() if k not in models.COMPUTE_FIELDS
    }  # same numbers
    return {
        "model": model,
        "mode": config.mode,
        "group_size": config.coordinator.group_size,
        "k_max": config.coordinator.k_max,
        "task": str(config.task.kind),
        "seed": config.seed,
    }


def check_resumable(saved: dict, current: dict) -> None:
    """Refuses a resume whose config changes what cannot change, listing every difference."""
    problems = []
    for key in ("mode", "group_size", "task", "seed"):
        if saved.get(key) != current[key]:
            problems.append(f"{key}: checkpoint {saved.get(key)!r}, config {current[key]!r}")
    for key, value in current["model"].items():
        if saved["model"].get(key) != value:
            problems.append(f"model.{key}: checkpoint {saved['model'].get(key)}, config {value}")
    if current["k_max"] < saved["k_max"]:
        problems.append(
            f"coordinator.k_max: checkpoint {saved['k_max']}, config {current['k_max']} (a smaller "
            "window could strand trajectories admitted under the larger one)"
        )
    if problems:
        raise ValueError("cannot resume this workdir with this config; differences:\n  " + "\n  ".join(problems))


def versions_needed(state: dict, trainer_version: int) -> list[int]:
    """The versions older than the trainer's that the snapshot's unconsumed work still needs."""
    requests = state["dispatched"] + state["backlog"]
    needed = {r["version"] for r in requests} | {g["version"] for g in state["queue"]}
    needed |= {g["version"] for g in state["groups"].values()} | {t["version"] for t in state["unscored"]}
    needed.discard(trainer_version)
    return sorted(needed)


class PromptBook(dict):
    """The prompts a run's requests refer to, by id: the reward needs a trajectory's prompt (its
    answer) and a checkpoint the prompts of what is still in flight. A long run hands out a prompt
    per group for days; the book forgets a training prompt once nothing live refers to it, so it
    holds about what is in flight, not every prompt ever drawn. `live()` (the coordinator's
    `live_prompt_ids`, set once the coordinator exists) says what is live; what `keep` holds (the
    held-out evaluation prompts, asked again every round) is never forgotten. A pass runs in `add`
    (the coordinator's `next_prompt`, on its loop thread under its lock) when the book has doubled
    since the last one."""

    def __init__(self, min_pass: int = 1024):
        super().__init__()
        self.live: Callable[[], set[str]] | None = None
        self._keep: set[str] = set()
        self._min_pass = self._next_pass = min_pass  # entries before the first pass
        self.forgotten = 0

    def keep(self, prompts: Sequence[Prompt]) -> None:
        for prompt in prompts:
            self[prompt.prompt_id] = prompt
            self._keep.add(prompt.prompt_id)

    def add(self, prompt: Prompt) -> None:
        if len(self) >= self._next_pass and self.live is not None:
            live = self.live() | self._keep
            done = [pid for pid in self if pid not in live]
            for pid in done:
                del self[pid]
            self.forgotten += len(done)
            self._next_pass = max(self._min_pass, 2 * len(self))
        self[prompt.prompt_id] = prompt

    def follow(self, coordinator) -> None:
        """From now on, what is live is what `coordinator` (a Coordinator) still refers to."""
        self.live = coordinator.live_prompt_ids

    def snapshot_extra(self, source) -> dict:
        """A checkpoint's `extra`, taken with the coordinator's snapshot under its lock: the
        prompt source's position and the prompts the snapshot refers to (as JSON)."""
        live = self.live() if self.live is not None else set(self)
        return {"source": source.state(), "prompts": {pid: dataclasses.asdict(self[pid]) for pid in sorted(live)}}


def prompts_from_json(data: Mapping[str, dict]) -> dict[str, Prompt]:
    return {pid: Prompt(**{**p, "prompt_ids": tuple(p["prompt_ids"])}) for pid, p in data.items()}


def meta(state: dict, trainer_version: int, prompts_json: Mapping[str, dict], fp: dict) -> dict:
    return {
        "coordinator": state,
        "trainer_version": trainer_version,
        "versions": versions_needed(state, trainer_version),
        "prompts": dict(prompts_json),
        "fingerprint": fp,
    }


def trim_rows(path: str, start_step: int) -> None:
    """A resumed run rewrites the steps after its checkpoint (and re-evaluates from there): drop
    the lost process's rows of metrics.jsonl / eval_samples.jsonl."""
    if not fs.exists(path):
        return
    with fs.open(path) as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] < start_step:
                kept.append(line)
        except (json.JSONDecodeError, KeyError):
            continue  # a torn last row
    with fs.open(path, "w") as f:
        f.writelines(kept)
