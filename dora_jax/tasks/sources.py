"""Prompts from dataset files (JSON lines, Parquet, HF `datasets` on disk), with a field mapping.

`FileSource` visits the rows in a fresh seeded permutation every epoch (`default_rng([seed,
epoch])`), turns each into a `Prompt` (chat template applied, or plain text), and skips rows it
cannot use, counting each skip by reason in `source.skipped`:
  invalid JSON, not a JSON object, missing field 'x', empty prompt, prompt is not text or
  messages, empty answer, chat template failed, untokenizable prompt, prompt too long.
Skips are counted per visit (a bad row is counted again each epoch). Once at least
`min_rows_for_bad_check` rows (or the whole file) were visited, a skipped fraction above
`max_bad_fraction` raises ValueError naming the file, the reasons and the first bad row: a
mapping that names the wrong field fails fast instead of silently starving the run.

The position (epoch, index in the permutation, counters) is a small dict: `state()` /
`restore()` continue exactly where the source stopped.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from dora_jax.tasks.prompt import Prompt, Tokenizer
from dora_jax.tasks.row_files import BadRow, open_rows


@dataclasses.dataclass(frozen=True)
class SourceConfig:
    """Where the prompts are and how a row maps to a prompt. Fields are dotted paths into the
    row (`reward_model.ground_truth`)."""

    path: str  # local path, gs://bucket/file, file://...; a directory for hf_disk
    format: str = "auto"  # "auto" | "jsonl" | "parquet" | "hf_disk"
    split: str = "train"  # the split of a saved DatasetDict (hf_disk)
    prompt_field: str = "question"  # a string, or a list of {"role", "content"} messages
    answer_field: str = "answer"  # a string or a number
    id_field: str | None = None  # a row id; default "<file name>:<row index>"
    system_prompt: str | None = None  # prepended as a system message (or paragraph, plain)
    chat_template: bool = True  # render with tokenizer.apply_chat_template; False: plain text
    max_prompt_tokens: int = 2048  # longer prompts are skipped ("prompt too long")
    seed: int = 0  # epoch e's order is default_rng([seed, e]).permutation
    shuffle: bool = True  # False: file order every epoch
    num_epochs: int | None = None  # None: cycle forever; else StopIteration after that many
    max_bad_fraction: float = 0.1  # more skipped rows than this fraction is an error
    min_rows_for_bad_check: int = 100  # visits before the fraction is judged (or a whole pass)
    hold_out: int = 0  # the file's last N rows are never drawn: held out for evaluation (`held_out_prompts`)

    def __post_init__(self):
        if not 0 <= self.max_bad_fraction <= 1:
            raise ValueError(f"SourceConfig.max_bad_fraction={self.max_bad_fraction}: must be in [0, 1]")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"SourceConfig.max_prompt_tokens={self.max_prompt_tokens}: must be >= 1")
        if self.hold_out < 0:
            raise ValueError(f"SourceConfig.hold_out={self.hold_out}: must be >= 0")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ValueError(f"SourceConfig.num_epochs={self.num_epochs}: must be >= 1 or None")

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(f for f in (self.prompt_field, self.answer_field, self.id_field) if f)


def field_value(row: dict, path: str) -> Any:
    """row["a"]["b"] for path "a.b"; `BadRow("missing field 'a.b'")` if absent or None."""
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, dict) or value.get(part) is None:
            raise BadRow(f"missing field {path!r}")
        value = value[part]
    return value


def to_messages(prompt: Any, system_prompt: str | None) -> list[dict]:
    """A prompt field (text or a message list) as chat messages, the system prompt first."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise BadRow("empty prompt")
        messages = [{"role": "user", "content": prompt}]
    elif (
        isinstance(prompt, (list, tuple))
        and prompt
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
        )
    ):
        if not any(m["content"].strip() for m in prompt):
            raise BadRow("empty prompt")
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    elif isinstance(prompt, (list, tuple)) and not prompt:
        raise BadRow("empty prompt")
    else:
        raise BadRow("prompt is not text or messages", repr(prompt)[:80])
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def answer_text(answer: Any) -> str:
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise BadRow("answer is not text or a number", repr(answer)[:80])
    text = str(answer).strip()
    if not text:
        raise BadRow("empty answer")
    return text


class FileSource:
    """A deterministic, resumable prompt stream over one dataset file (see the module docstring)."""

    def __init__(self, config: SourceConfig, tokenizer: Tokenizer):
        if config.chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"SourceConfig.chat_template=True but {type(tokenizer).__name__} has no chat "
                "template; set chat_template=False to tokenize plain text"
            )
        self.config = config
        self._tokenizer = tokenizer
        needed = tuple(field.split(".")[0] for field in config.fields)
        self._rows = open_rows(config.path, config.format, needed, config.split)
        if self._rows.num_rows == 0:
            raise ValueError(f"{config.path}: no rows")
        if config.hold_out >= self._rows.num_rows:
            raise ValueError(
                f"{config.path}: {self._rows.num_rows} rows, all held out for evaluation "
                f"(hold_out={config.hold_out}: eval.num_prompts); lower it or give an eval file (eval.path)"
            )
        self._train_rows = self._rows.num_rows - config.hold_out
        self._name = os.path.basename(config.path.rstrip("/"))
        self.skipped: collections.Counter[str] = collections.Counter()
        self.examined = 0
        self._first_bad: str | None = None
        self._epoch, self._position, self._good_this_epoch = 0, 0, 0
        self._order = self._permutation(0)

    @property
    def num_rows(self) -> int:
        return self._rows.num_rows

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.config.shuffle:
            return np.arange(self._train_rows)
        return np.random.default_rng([self.config.seed, epoch]).permutation(self._train_rows)

    def held_out_prompts(self) -> list[Prompt]:
        """The usable prompts among the last `hold_out` rows, in file order (never drawn by `next`)."""
        prompts = []
        for row_index in range(self._train_rows, self.num_rows):
            try:
                prompts.append(self.prompt(row_index))
            except BadRow:
                continue
        return prompts

    def next(self) -> Prompt:
        while True:
            if self._position >= self._train_rows:
                self._start_epoch(self._epoch + 1)
            row_index = int(self._order[self._position])
            self._position += 1
            self.examined += 1
            try:
                prompt = self.prompt(row_index)
            except BadRow as bad:
                self._count_bad(row_index, bad)
                continue
            self._good_this_epoch += 1
            return prompt

    def __iter__(self) -> Iterator[Prompt]:
        while True:
            try:
                yield self.next()
            except StopIteration:
                return

    def _start_epoch(self, epoch: int) -> None:
        if self._good_this_epoch == 0:
            raise ValueError(
                f"{self.config.path}: no usable row in a whole pass; skipped {dict(self.skipped)}; "
                f"first bad row: {self._first_bad}"
            )
        if self.config.num_epochs is not None and epoch >= self.config.num_epochs:
            raise StopIteration
        self._epoch, self._position, self._good_this_epoch = epoch, 0, 0
        self._order = self._permutation(epoch)

    def _count_bad(self, row_index: int, bad: BadRow) -> None:
        self.skipped[bad.reason] += 1
        if self._first_bad is None:
            self._first_bad = f"row {row_index}: {bad}"
        judged = self.examined >= min(self.config.min_rows_for_bad_check, self._train_rows)
        bad_count = sum(self.skipped.values())
        if judged and bad_count > self.config.max_bad_fraction * self.examined:
            c = self.config
            raise ValueError(
                f"{c.path}: {bad_count} of {self.examined} rows skipped, more than max_bad_fraction="
                f"{c.max_bad_fraction}: {dict(self.skipped.most_common())}; first bad row: {self._first_bad}; "
                f"fields: prompt_field={c.prompt_field!r} answer_field={c.answer_field!r} "
                f"id_field={c.id_field!r}; the file's columns: {list(self._rows.columns)}"
            )

    def prompt(self, row_index: int) -> Prompt:
        """Row `row_index` as a Prompt; raises `BadRow` if it cannot be one."""
        c = self.config
        row = self._rows.row(row_index)
        messages = to_messages(field_value(row, c.prompt_field), c.system_prompt)
        answer = answer_text(field_value(row, c.answer_field))
        prompt_id = str(field_value(row, c.id_field)) if c.id_field else f"{self._name}:{row_index}"
        if c.chat_template:
            try:
                text = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            except Exception as err:  # jinja2 errors, raise_exception() in the template
                raise BadRow("chat template failed", str(err)) from None
            add_special_tokens = False  # the template writes its own BOS
        else:
            text = "\n\n".join(m["content"] for m in messages)
            add_special_tokens = True
        try:
            ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except ValueError as err:
            raise BadRow("untokenizable prompt", str(err)) from None
        if len(ids) > c.max_prompt_tokens:
            raise BadRow("prompt too long", f"{len(ids)} > max_prompt_tokens={c.max_prompt_tokens}")
        metadata = {"source": c.path, "row": row_index, "epoch": self._epoch}
        return Prompt(prompt_id, text, tuple(ids), answer, metadata)

    def state(self) -> dict:
        return {
            "kind": "file",
            "path": self.config.path,
            "num_rows": self.num_rows,
            "seed": self.config.seed,
            "shuffle": self.config.shuffle,
            "hold_out": self.config.hold_out,
            "epoch": self._epoch,
            "position": self._position,
            "good_this_epoch": self._good_this_epoch,
            "examined": self.examined,
            "skipped": dict(self.skipped),
            "first_bad": self._first_bad,
        }

    def restore(self, state: dict) -> None:
        """Continues from `state()`; refuses a state from another file, size, seed or order."""
        mine = self.state()
        for key in ("kind", "path", "num_rows", "seed", "shuffle", "hold_out"):
            if state.get(key, 0 if key == "hold_out" else None) != mine[key]:
                raise ValueError(
                    f"{self.config.path}: cannot restore source state: {key} is "
                    f"{state.get(key)!r} in the state but {mine[key]!r} here"
                )
        self._epoch, self._position = int(state["epoch"]), int(state["position"])
        self._good_this_epoch = int(state["good_this_epoch"])
        self.examined = int(state["examined"])
        self.skipped = collections.Counter(state["skipped"])
        self._first_bad = state["first_bad"]
        self._order = self._permutation(self._epoch)
