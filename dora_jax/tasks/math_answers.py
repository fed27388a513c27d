"""Final-answer checking for math data: numeric (GSM8K-style) and symbolic (MATH / DAPO-Math).

Reward functions here have the signature `(prompt: Prompt, response_text: str) -> float`, are
top-level (picklable by reference, so `RewardPool` can run them in worker processes) and raise
only when the *reference* answer is unusable, which the pool records as an error (the sample is
masked out of the loss rather than scored 0).

Numeric extraction, in order of precedence:
1. the text after the last `####` (GSM8K's answer marker),
2. the content of the last `\\boxed{...}` / `\\fbox{...}`,
3. otherwise the last number anywhere in the text.
Numbers may carry thousands separators (1,234), a sign, decimals (-0.5, .5), a leading `$`, a
trailing `%`, or be a simple fraction (3/4, \\frac{3}{4}); they compare exactly as rationals,
with a relative tolerance of 1e-6 for rounded decimals.
"""

from __future__ import annotations

import re
from fractions import Fraction

from dora_jax.tasks.prompt import Prompt

_NUMBER = (
    r"(?:(?<![\w)\]}])-)?"  # a minus sign, unless it reads as subtraction (5-3)
    r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
)
_FRACTION_RE = re.compile(r"\\[dt]?frac\{\s*(" + _NUMBER + r")\s*\}\{\s*(" + _NUMBER + r")\s*\}")
_NUMBER_RE = re.compile(r"(" + _NUMBER + r")(?:\s*/\s*(" + _NUMBER + r"))?")
# Units and spacing that may surround a boxed number: "12 \\text{ apples}", "\\$5", "50\\%".
_DECORATION_RE = re.compile(r"\\(?:text|mathrm|mbox)\{[^{}]*\}|\\[$%,;!]|\\(?:left|right)|[$%]")
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_RELATIVE_TOLERANCE = Fraction(1, 10**6)


def boxed_contents(text: str) -> list[str]:
    """The contents of every `\\boxed{...}` / `\\fbox{...}` in text, braces balanced."""
    contents = []
    for match in _BOXED_RE.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                contents.append(text[start:i])
                break
    return contents


def _to_fraction(number: str) -> Fraction:
    return Fraction(number.replace(",", ""))


def _numbers(text: str) -> list[Fraction]:
    """Every number in text, left to right; `\\frac{a}{b}` and `a/b` become one fraction."""
    text = text.replace("\u2212", "-")  # unicode minus
    text = _FRACTION_RE.sub(lambda m: f"{m.group(1)}/{m.group(2)}", text)
    values = []
    for match in _NUMBER_RE.finditer(text):
        value = _to_fraction(match.group(1))
        if match.group(2) is not None:
            denominator = _to_fraction(match.group(2))
            if denominator == 0:
                continue
            value /= denominator
        values.append(value)
    return values


def extract_number(text: str) -> Fraction | None:
    """The final numeric answer of text (see the module docstring), or None if there is none."""
    if "####" in text:
        segment = text.rsplit("####", 1)[1].strip().split("\n", 1)[0]
        numbers = _numbers(segment)
        return numbers[0] if numbers else None
    boxed = boxed_contents(text)
    if boxed:
        content = _DECORATION_RE.sub("", boxed[-1])
        numbers = _numbers(content)
        if len(numbers) != 1 or re.search("[A-Za-z]", _FRACTION_RE.sub("", content)):
            return None  # a symbolic or compound boxed answer is not a number
        return numbers[0]
    numbers = _numbers(text)
    return numbers[-1] if numbers else None


def numbers_match(predicted: Fraction, reference: Fraction) -> bool:
    if predicted == reference:
        return True
    return abs(predicted - reference) <= _RELATIVE_TOLERANCE * max(1, abs(reference))


def numeric_reward(prompt: Prompt, response_text: str) -> float:
    """1.0 if the response's final number equals the reference's, else 0.0 (GSM8K-style).

    The reference answer may be a bare number or a full GSM8K solution ending in `#### 72`.
    Raises ValueError if the reference holds no number.
    """
    reference = extract_number(prompt.answer)
    if reference is None:
        raise ValueError(f"prompt {prompt.prompt_id!r}: no number in reference answer {prompt.answer!r}")
    predicted = extract_number(response_text)
    return 1.0 if predicted is not None and numbers_match(predicted, reference) else 0.0


def math_verify_reward(prompt: Prompt, response_text: str) -> float:
    """1.0 if math-verify finds the response's answer equivalent to the reference, else 0.0.

    The reference is parsed as LaTeX (`\\boxed{...}` if it has one, else wrapped in `$...$`); the
    response with math-verify's default extraction (boxed, then last LaTeX / plain expression).
    math-verify's own signal-based timeouts are off: they fail outside a main thread, and the
    `RewardPool` bounds the time per sample by killing the worker process instead.
    Raises ValueError if the reference cannot be parsed.
    """
    try:
        import math_verify
    except ImportError:
        raise ImportError("math_verify_reward needs the math-verify package: pip install math-verify") from None
    answer = prompt.answer.strip()
    gold_text = answer if "\\boxed" in answer or "$" in answer else f"${answer}$"
    gold = math_verify.parse(gold_text, parsing_timeout=None)
    if not gold:
        raise ValueError(f"prompt {prompt.prompt_id!r}: math-verify cannot parse the reference {answer!r}")
    predicted = math_verify.parse(response_text, parsing_timeout=None)
    if not predicted:
        return 0.0
    return 1.0 if math_verify.verify(gold, predicted, timeout_seconds=None) else 0.0
