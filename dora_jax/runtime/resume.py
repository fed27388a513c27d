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
from collections.abc import Mapping

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


def live_prompts(state: dict, prompts: Mapping[str, Prompt]) -> dict[str, dict]:
    """The prompts (as JSON) of the snapshot's in-flight requests and unscored trajectories."""
    live = {r["prompt_id"] for r in state["dispatched"] + state["backlog"]}
    live |= {t["prompt_id"] for t in state["unscored"]}
    return {pid: dataclasses.asdict(prompts[pid]) for pid in sorted(live)}


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
