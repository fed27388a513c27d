"""Held-out evaluation prompts for a task (`eval.num_prompts`, optionally from `eval.path`).

  running_sums   draws from the task's distribution on a stream training never uses
                 (`RunningSumsSource.held_out`)
  file tasks     `eval.path`: the first usable rows of that file, read with the training file's
                 field mapping; no path: the last `eval.num_prompts` rows of the training file,
                 which the training source then never draws (`SourceConfig.hold_out`)

Evaluation prompt ids start with "eval/", so they never collide with a training prompt's.
`LeakCounter` counts the training prompts whose text is also an evaluation prompt (a leak the run
reports: duplicated rows in a file, the same question in both files, or the short prompts a
synthetic task cannot avoid repeating).
"""

from __future__ import annotations

import dataclasses

from dora_jax.tasks.prompt import Prompt, Tokenizer
from dora_jax.tasks.running_sums import RunningSumsSource
from dora_jax.tasks.sources import FileSource
from dora_jax.tasks.task import Task, TaskConfig


def eval_prompts(
    config: TaskConfig, task: Task, tokenizer: Tokenizer, num_prompts: int, path: str = ""
) -> list[Prompt]:
    """`num_prompts` held-out prompts (see the module docstring); errors name eval.path / eval.num_prompts."""
    if isinstance(task.source, RunningSumsSource):
        if path:
            raise ValueError(
                f"eval.path={path!r}: task.kind 'running_sums' draws its own held-out prompts; leave it ''"
            )
        prompts = [task.source.held_out(i) for i in range(num_prompts)]
    elif path:
        assert config.source is not None  # file tasks always have one (TaskConfig checks)
        source_config = dataclasses.replace(config.source, path=path, shuffle=False, num_epochs=1, hold_out=0)
        try:
            source = FileSource(source_config, tokenizer)
            prompts = []
            for prompt in source:
                prompts.append(prompt)
                if len(prompts) == num_prompts:
                    break
        except (OSError, ValueError, KeyError) as err:
            raise ValueError(f"eval.path={path!r}: {err}") from err
        if len(prompts) < num_prompts:
            raise ValueError(
                f"eval.path={path!r} has {len(prompts)} usable prompts (skipped: {dict(source.skipped)}); "
                f"eval.num_prompts={num_prompts}"
            )
    else:
        if not isinstance(task.source, FileSource) or task.source.config.hold_out != num_prompts:
            raise ValueError(
                f"task {task.kind!r}: the training source holds out no rows for eval.num_prompts={num_prompts}"
            )
        prompts = task.source.held_out_prompts()
        if not prompts:
            raise ValueError(f"{task.source.config.path}: none of the last {num_prompts} rows (held out) is usable")
    return [dataclasses.replace(p, prompt_id=f"eval/{p.prompt_id}") for p in prompts]


class LeakCounter:
    """Counts training prompts whose text is one of the evaluation prompts'."""

    def __init__(self, prompts: list[Prompt]):
        self._texts = {p.text for p in prompts}
        self.leaked = 0  # training prompts drawn so far that are also evaluation prompts
        self.leaked_texts: set[str] = set()

    def check(self, prompt: Prompt) -> None:
        if prompt.text in self._texts:
            self.leaked += 1
            self.leaked_texts.add(prompt.text)

    @property
    def eval_prompts_seen_in_training(self) -> int:
        return len(self.leaked_texts)
