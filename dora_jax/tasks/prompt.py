"""The `Prompt` record every task produces, and the interfaces tasks rely on.

A prompt source is an infinite (or epoch-bounded) deterministic stream whose position can be
saved with `state()` and restored with `restore()`, so that a resumed run sees the same
prompts in the same order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, Protocol


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt, ready for the engine.

    `prompt_id` names the dataset row (stable across epochs); `text` is what was tokenized
    (chat template applied when the source asked for it); `answer` is the reference answer the
    reward function checks against; `metadata` holds small JSON-compatible facts (source file,
    row index, epoch) and takes no part in equality or hashing.
    """

    prompt_id: str
    text: str
    prompt_ids: tuple[int, ...]
    answer: str
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids)


class Tokenizer(Protocol):
    """What sources need from `dora_jax.models.tokenizer.HFTokenizer` / `CharTokenizer`.

    Chat-template sources also call `apply_chat_template(messages, add_generation_prompt=True)`.
    """

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class PromptSource(Protocol):
    """A deterministic, resumable stream of prompts."""

    def next(self) -> Prompt:
        """The next prompt; raises StopIteration when a bounded source is exhausted."""
        ...

    def state(self) -> dict:
        """A JSON-compatible position; `restore(state())` on a fresh source continues here."""
        ...

    def restore(self, state: dict) -> None: ...

    def __iter__(self) -> Iterator[Prompt]: ...
