"""The coordinator role, for every placement: its prompt supply (`PromptDrawer`), the held-out
evaluation prompts, the `Coordinator` built over the rollout slices' ports, its restore from a
checkpoint's state, and its event loop (`serve`).

The embedded placement (dora_jax.runtime.runner) calls these with in-process ports and a loop
thread; the process placement (dora_jax.runtime.placements.coordinator_process) with the gRPC service's ports, one
generation per trainer (re)start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from dora_jax.coordinator.coordinator import Coordinator
from dora_jax.coordinator.ledger import Ledger
from dora_jax.runtime import faults, resume
from dora_jax.runtime.run_config import RunConfig, task_config
from dora_jax.tasks.eval_set import LeakCounter, eval_prompts
from dora_jax.tasks.prompt import Prompt


def held_out_prompts(config: RunConfig, task, tokenizer) -> list[Prompt]:
    """The run's evaluation prompts (dora_jax.tasks.eval_set); none when the run does not evaluate."""
    if not config.eval.enabled:
        return []
    return eval_prompts(task_config(config), task, tokenizer, config.eval.num_prompts, config.eval.path)


class PromptDrawer:
    """The coordinator's `next_prompt`: draws from the task's source, books every prompt (the
    reward and checkpoints read prompts by id; the held-out ones are kept for every round) and
    counts the training prompts that are also evaluation prompts."""

    def __init__(self, task, held_out: list[Prompt]):
        self.task = task
        self.book = resume.PromptBook()
        self.book.keep(held_out)
        self.leaks = LeakCounter(held_out)

    def __call__(self) -> tuple[str, tuple[int, ...]]:
        prompt = self.task.source.next()
        self.book.add(prompt)
        self.leaks.check(prompt)
        return prompt.prompt_id, prompt.prompt_ids

    def snapshot_extra(self) -> dict:
        """A checkpoint's `extra` (the source's position and the live prompts), under the
        coordinator's lock."""
        return self.book.snapshot_extra(self.task.source)

    def leak_counts(self) -> dict:
        return {
            "eval/leaked_train_prompts": self.leaks.leaked,
            "eval/prompts_seen_in_training": self.leaks.eval_prompts_seen_in_training,
        }


def build(
    config: RunConfig,
    ports: Mapping,
    drawer: PromptDrawer,
    scorer,
    ledger: Ledger,
    *,
    vocab_size: int,
    initial_version: int,
    forced_length: Callable | None = None,
    on_slice_dropped: Callable | None = None,
) -> Coordinator:
    """The Coordinator over `ports` (results checked against the model's vocabulary,
    dora_jax.coordinator.intake); the drawer's book forgets what it no longer refers to."""
    coord = Coordinator(
        dataclasses.replace(config.coordinator, vocab_size=vocab_size),
        dict(ports),
        drawer,
        scorer,
        ledger,
        forced_length=forced_length,
        initial_version=initial_version,
        on_slice_dropped=on_slice_dropped,
    )
    drawer.book.follow(coord)
    return coord


def restore(coord: Coordinator, drawer: PromptDrawer, state: dict | None) -> None:
    """A resumed run's coordinator: `state` is what a checkpoint holds for it ({"coordinator":
    its snapshot, "prompts": the live prompts}) or None (no checkpoint restored: the run starts
    over, and the ledger's `resume` event voids what the lost run wrote)."""
    if state is not None:
        drawer.task.source.restore(state["coordinator"]["extra"]["source"])
        drawer.book.update(resume.prompts_from_json(state["prompts"]))
    coord.restore(state["coordinator"] if state is not None else None)


def serve(coord: Coordinator, running: Callable[[], bool], check: Callable[[], None] | None = None) -> None:
    """The coordinator's event loop: handles what is posted to it until `running()` is false;
    `check()` after each pass (the embedded placement's slice supervisor). Raises what the
    coordinator raises."""
    while running():
        if coord.process(timeout=0.005):
            faults.reached("rollout")
        if check is not None:
            check()
