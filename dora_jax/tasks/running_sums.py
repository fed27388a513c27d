"""Running sums: a synthetic reasoning task with long-tailed response lengths and an exact reward.

The prompt lists k small numbers (0..`max_term`), each behind a position tag (a..z, then A..Z);
the response walks the list: for each tag it writes the tag, the term it looked up and the running
sum so far mod `modulus`, then ';' and the final sum:

    prompt    a2b1c2d0e1=
    response  a22b13c25d05e16;6      (then EOS)

Why tags: without them, the model must fetch the i-th prompt term at an offset that depends on
k, which a 2-layer char-level transformer learns slowly. With them, fetching a term is an
induction-head lookup (find the tag just written in the prompt, copy the term after it).
Why the response repeats the term: then the addition is local (the term one token back, the
previous sum three tokens back) instead of fused with the lookup; measured on the smoke model,
writing only the sums ("a2b3c5...") left the sum digits at 24% teacher-forced accuracy after 300
SFT updates, writing the term first lifted them to 44%.
Why terms 0..2 by default: the step is then a 30-entry table (previous sum x term), which the
smoke model learns exactly (100% teacher-forced sum accuracy after 300 updates); with terms 0..9
(a 100-entry table) it had not learned it after 300 updates. With modulus 10 every sum is one
digit, so each step costs exactly three tokens and the response is 3k + 2 characters (+ EOS).

k is a discretised log-normal (median `median_k`, shape `sigma`) clipped to [1, k_max]: with the
defaults (median 3, sigma 1, k_max 52) the response is 12 tokens at the median and 159 at the
max, about 13x (`python -m dora_jax.tasks.running_sums` measures it).

The reward is 1 for a well-formed response (exactly k steps of tag, one digit, a number, in tag
order, then ';' and a number) whose final answer is right, 0 otherwise; the copied terms and the
intermediate sums are not graded.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import string
from collections.abc import Iterator

import numpy as np

from dora_jax.tasks.prompt import Prompt, Tokenizer

TAGS = string.ascii_lowercase + string.ascii_uppercase
ALPHABET = string.digits + ";=" + TAGS  # for CharTokenizer(ALPHABET): vocab 3 specials + 64

_PROMPT_RE = re.compile(r"((?:[a-zA-Z][0-9])+)=")
_RESPONSE_RE = re.compile(r"((?:[a-zA-Z][0-9][0-9]+)+);([0-9]+)")
_STEP_RE = re.compile(r"([a-zA-Z])([0-9]+)")  # prompt steps: tag, term
_RESPONSE_STEP_RE = re.compile(r"([a-zA-Z])([0-9])([0-9]+)")  # response steps: tag, term, sum


@dataclasses.dataclass(frozen=True)
class RunningSumsConfig:
    """The task's distribution. Lengths: response = 3k + 2 characters + EOS (modulus 10)."""

    median_k: float = 3.0  # median number of terms (log-normal scale exp(mu))
    sigma: float = 1.0  # log-normal shape: larger means a longer tail
    k_max: int = 52  # clip; at most len(TAGS) = 52
    max_term: int = 2  # terms are uniform in 0..max_term (2: the step is a 30-entry table)
    modulus: int = 10  # running sums are taken mod this; 10 keeps every sum one digit
    seed: int = 0  # PromptSource seed: prompt i is drawn from default_rng([seed, i])

    def __post_init__(self):
        if not 1 <= self.k_max <= len(TAGS):
            raise ValueError(f"RunningSumsConfig.k_max={self.k_max}: must be in [1, {len(TAGS)}]")
        if not self.median_k >= 1:
            raise ValueError(f"RunningSumsConfig.median_k={self.median_k}: must be >= 1")
        if not self.sigma >= 0:
            raise ValueError(f"RunningSumsConfig.sigma={self.sigma}: must be >= 0")
        if not 1 <= self.max_term <= 9:
            raise ValueError(f"RunningSumsConfig.max_term={self.max_term}: must be in [1, 9]")
        if not 2 <= self.modulus <= 1000:
            raise ValueError(f"RunningSumsConfig.modulus={self.modulus}: must be in [2, 1000]")


def sample_k(rng: np.random.Generator, config: RunningSumsConfig) -> int:
    """Number of terms: round(LogNormal(log(median_k), sigma)) clipped to [1, k_max]."""
    k = rng.lognormal(mean=math.log(config.median_k), sigma=config.sigma)
    return int(min(max(round(k), 1), config.k_max))


def draw_terms(rng: np.random.Generator, config: RunningSumsConfig) -> list[int]:
    """k = `sample_k` terms, uniform in 0..max_term."""
    k = sample_k(rng, config)
    return [int(t) for t in rng.integers(0, config.max_term + 1, size=k)]


def prompt_text(terms: list[int]) -> str:
    if not 1 <= len(terms) <= len(TAGS) or any(not 0 <= t <= 9 for t in terms):
        raise ValueError(f"terms must be 1..{len(TAGS)} digits 0-9, got {terms}")
    return "".join(f"{tag}{t}" for tag, t in zip(TAGS, terms)) + "="


def parse_terms(text: str) -> list[int]:
    """The digits of a running-sums prompt text; ValueError if it is not one."""
    match = _PROMPT_RE.fullmatch(text)
    if match is None:
        raise ValueError(f"not a running-sums prompt: {text!r}")
    steps = _STEP_RE.findall(match.group(1))
    if "".join(tag for tag, _ in steps) != TAGS[: len(steps)]:
        raise ValueError(f"running-sums prompt tags out of order: {text!r}")
    return [int(value) for _, value in steps]


def running_sums(terms: list[int], modulus: int) -> list[int]:
    return [int(s) % modulus for s in np.cumsum(terms)]


def make_prompt(
    rng: np.random.Generator, config: RunningSumsConfig, tokenizer: Tokenizer, prompt_id: str = ""
) -> Prompt:
    """One prompt: k from `sample_k`, terms uniform in 0..max_term; ids start with BOS."""
    terms = draw_terms(rng, config)
    text = prompt_text(terms)
    answer = running_sums(terms, config.modulus)[-1]
    return Prompt(
        prompt_id=prompt_id,
        text=text,
        prompt_ids=tuple(tokenizer.encode(text, add_special_tokens=True)),
        answer=str(answer),
        metadata={"k": len(terms), "modulus": config.modulus},
    )


def demonstration(prompt: Prompt) -> str:
    """The correct response text (without EOS), for supervised warm-up."""
    terms = parse_terms(prompt.text)
    return _response(terms, _modulus(prompt))


def _response(terms: list[int], modulus: int) -> str:
    sums = running_sums(terms, modulus)
    return "".join(f"{tag}{t}{s}" for tag, t, s in zip(TAGS, terms, sums)) + f";{sums[-1]}"


def reward(prompt: Prompt, response_text: str) -> float:
    """1.0 if the response is well formed (k tagged steps of term and sum, ';', a number) and its
    final answer is the true running sum; 0.0 otherwise. Raises ValueError only for a malformed
    *prompt*."""
    terms = parse_terms(prompt.text)
    match = _RESPONSE_RE.fullmatch(response_text)
    if match is None:
        return 0.0
    tags = "".join(tag for tag, _, _ in _RESPONSE_STEP_RE.findall(match.group(1)))
    if tags != TAGS[: len(terms)]:
        return 0.0
    expected = running_sums(terms, _modulus(prompt))[-1]
    return 1.0 if match.group(2) == str(expected) else 0.0


def response_length(k: int) -> int:
    """Response tokens for k terms with modulus 10: 3k + 2 characters and EOS."""
    return 3 * k + 3


def _modulus(prompt: Prompt) -> int:
    return int(prompt.metadata.get("modulus", 10))


class RunningSumsSource:
    """Infinite deterministic stream: prompt i is drawn from `default_rng([seed, i])`, so the
    position is a single integer and any prompt can be regenerated on its own."""

    def __init__(self, config: RunningSumsConfig, tokenizer: Tokenizer):
        try:
            tokenizer.encode(ALPHABET)
        except ValueError as err:
            raise ValueError(f"tokenizer cannot encode the running-sums alphabet {ALPHABET!r}: {err}") from err
        self.config = config
        self._tokenizer = tokenizer
        self._index = 0

    def prompt(self, index: int) -> Prompt:
        rng = np.random.default_rng([self.config.seed, index])
        return make_prompt(rng, self.config, self._tokenizer, f"running_sums/{self.config.seed}/{index}")

    def held_out(self, index: int) -> Prompt:
        """Evaluation prompt `index`: the same distribution from a stream training never draws
        (`default_rng([seed, index, 1])`). Short prompts still recur in training (there are only
        3^k prompts of k terms): the task has no held-out strings, only held-out draws."""
        rng = np.random.default_rng([self.config.seed, index, 1])
        return make_prompt(rng, self.config, self._tokenizer, f"running_sums/{self.config.seed}/eval{index}")

    def next(self) -> Prompt:
        prompt = self.prompt(self._index)
        self._index += 1
        return prompt

    def __iter__(self) -> Iterator[Prompt]:
        while True:
            yield self.next()

    def state(self) -> dict:
        return {"kind": "running_sums", "seed": self.config.seed, "index": self._index}

    def restore(self, state: dict) -> None:
        if state.get("kind") != "running_sums" or state.get("seed") != self.config.seed:
            raise ValueError(f"cannot restore running-sums source (seed {self.config.seed}) from state {state}")
        self._index = int(state["index"])


def length_stats(config: RunningSumsConfig, num_prompts: int) -> dict[str, float]:
    """Measured response lengths (tokens, EOS included) of `num_prompts` demonstrations."""
    values = np.asarray(
        [
            len(_response(draw_terms(np.random.default_rng([config.seed, index]), config), config.modulus)) + 1
            for index in range(num_prompts)
        ]
    )
    return {
        "num_prompts": num_prompts,
        "median": float(np.median(values)),
        "mean": float(values.mean()),
        "p99": float(np.percentile(values, 99)),
        "max": float(values.max()),
        "max_over_median": float(values.max() / np.median(values)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="Response-length distribution of running sums.")
    parser.add_argument("--num_prompts", type=int, default=100_000)
    parser.add_argument("--median_k", type=float, default=RunningSumsConfig.median_k)
    parser.add_argument("--sigma", type=float, default=RunningSumsConfig.sigma)
    parser.add_argument("--k_max", type=int, default=RunningSumsConfig.k_max)
    parser.add_argument("--max_term", type=int, default=RunningSumsConfig.max_term)
    args = parser.parse_args()
    config = RunningSumsConfig(median_k=args.median_k, sigma=args.sigma, k_max=args.k_max, max_term=args.max_term)
    print(length_stats(config, args.num_prompts))


if __name__ == "__main__":
    main()
