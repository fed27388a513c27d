"""Tokenizers: HF `tokenizers` (tokenizer.json) with chat templates, and a char-level one for
synthetic tasks. Both expose `encode`, `decode`, `eos_ids`, `pad_id`, `vocab_size`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


class HFTokenizer:
    """A HF fast tokenizer read from `path/tokenizer.json`, with `tokenizer_config.json`'s
    special tokens and chat template (rendered with a sandboxed jinja2, as transformers does)."""

    def __init__(self, path: str):
        file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(file):
            raise FileNotFoundError(f"{file}: not found; expected a HF tokenizer.json")
        self._tok = Tokenizer.from_file(file)
        config_file = os.path.join(path, "tokenizer_config.json")
        self.config: dict = {}
        if os.path.exists(config_file):
            with open(config_file) as f:
                self.config = json.load(f)
        template = self.config.get("chat_template")
        if template is None and os.path.exists(os.path.join(path, "chat_template.jinja")):
            with open(os.path.join(path, "chat_template.jinja")) as f:
                template = f.read()
        self.chat_template: str | None = template
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.pad_token = _token_text(self.config.get("pad_token"))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        eos = self.token_id(self.eos_token)
        return () if eos is None else (eos,)

    @property
    def pad_id(self) -> int:
        for token in (self.pad_token, self.eos_token):
            if self.token_id(token) is not None:
                return self.token_id(token)
        return 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Renders `messages` with the checkpoint's chat template to a string."""
        if not self.chat_template:
            raise ValueError("tokenizer_config.json has no chat_template; pass prompts as plain text")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        return env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised as {"content": ...}
        return value.get("content")
    return value


class CharTokenizer:
    """One id per character of a fixed alphabet, after three specials: pad=0, bos=1, eos=2."""

    PAD, BOS, EOS = 0, 1, 2

    def __init__(self, alphabet: str):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet has repeated characters: {alphabet!r}")
        self.alphabet = alphabet
        self._ids = {ch: i + 3 for i, ch in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet) + 3

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return (self.EOS,)

    @property
    def pad_id(self) -> int:
        return self.PAD

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        try:
            ids = [self._ids[ch] for ch in text]
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in the alphabet {self.alphabet!r}") from None
        return [self.BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i < 3:
                if not skip_special_tokens:
                    out.append(("<pad>", "<bos>", "<eos>")[i])
                continue
            if i >= self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
            out.append(self.alphabet[i - 3])
        return "".join(out)
