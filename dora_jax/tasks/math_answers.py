"""Final-answer grading for math data: numeric (GSM8K-style) and symbolic (MATH / DAPO-Math).

Reward functions here have the signature `(prompt: Prompt, response_text: str) -> float` (plus a
`fallback_last_number` keyword a task binds with `functools.partial`), are top-level (picklable by
reference, so `RewardPool` can run them in worker processes) and raise only when the *reference*
answer is unusable, which the pool records as an error (the sample is masked out of the loss).

`grade` reads the response's stated answer as a person would (`answer_reading`: the last
`\\boxed{}`, then an `Answer:` line, then GSM8K's `#### N`, then the last number only where the task
opts in) and compares it with the reference's:
- both read as one number: exactly as rationals (relative tolerance 1e-6 for rounded decimals);
  a percentage matches its number as written or divided by 100 (`50\\%` is right for 50 and 0.5);
- the response states a COMPOUND answer (`5 hours and 30 minutes`): ungradeable, scored 0;
- otherwise, for the symbolic reward only, math-verify decides on the two stated answers (each
  wrapped in `\\boxed{}`); the numeric reward scores 0.
math-verify alone (its own extraction on the whole response) reads some answers differently; the
CLI lists those rows, and docs/grading.md the known cases:

    python -m dora_jax.tasks.math_answers --input=rows.jsonl [--response_field=response]
        [--answer_field=answer] [--fallback_last_number]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
from fractions import Fraction

from dora_jax.tasks.answer_reading import (
    AnswerSource,
    Reading,
    ReadingKind,
    StatedAnswer,
    find_answer,
    read_answer,
)
from dora_jax.tasks.prompt import Prompt

_RELATIVE_TOLERANCE = Fraction(1, 10**6)


@dataclasses.dataclass(frozen=True)
class Grade:
    """A response's score and how it was reached."""

    score: float  # 1.0 or 0.0
    method: str  # "numeric" | "math_verify" | "no_answer" (nothing stated) | "ungradeable"
    stated: StatedAnswer | None  # the span the response states as its answer
    reading: Reading | None  # what that span reads as


def extract_number(text: str, fallback_last_number: bool = False) -> Fraction | None:
    """The value of text's stated answer if it reads as one number (a percentage as written)."""
    stated = find_answer(text, fallback_last_number)
    if stated is None:
        return None
    reading = read_answer(stated.text)
    return reading.value if reading.kind is ReadingKind.NUMBER else None


def numbers_match(predicted: Fraction, reference: Fraction) -> bool:
    if predicted == reference:
        return True
    return abs(predicted - reference) <= _RELATIVE_TOLERANCE * max(1, abs(reference))


def _values(reading: Reading) -> tuple[Fraction, ...]:
    assert reading.value is not None
    return (reading.value, reading.value / 100) if reading.percent else (reading.value,)


def readings_match(predicted: Reading, reference: Reading) -> bool:
    """Two NUMBER readings name the same value (a percentage either as written or over 100)."""
    return any(numbers_match(p, r) for p in _values(predicted) for r in _values(reference))


def reference_answer(reference: str) -> StatedAnswer:
    """The reference's stated answer (`\\boxed{}`, `Answer:`, `####`), else the whole reference."""
    return find_answer(reference) or StatedAnswer(reference, AnswerSource.WHOLE)


def _math_verify_equal(reference: str, response: str, timeout_s: int | None) -> bool:
    """math-verify on two stated answers. `timeout_s=None`: no signal-based timeouts, which fail
    outside a main thread (the `RewardPool` bounds the time per sample by killing the worker)."""
    import math_verify

    gold = math_verify.parse(f"\\boxed{{{reference}}}", parsing_timeout=timeout_s)
    if not gold:
        raise ValueError(f"math-verify cannot parse the reference answer {reference!r}")
    predicted = math_verify.parse(f"\\boxed{{{response}}}", parsing_timeout=timeout_s)
    return bool(predicted) and math_verify.verify(gold, predicted, timeout_seconds=timeout_s)


def grade(
    response: str,
    reference: str,
    *,
    fallback_last_number: bool = False,
    symbolic: bool = False,
    timeout_s: int | None = None,
) -> Grade:
    """Grades response against reference (module docstring). Raises ValueError when the reference
    states no number (`symbolic=False`) or math-verify cannot parse it (`symbolic=True`)."""
    gold_span = reference_answer(reference)
    gold = read_answer(gold_span.text)
    if gold.kind is not ReadingKind.NUMBER and not symbolic:
        raise ValueError(f"no number in reference answer {reference!r}")
    stated = find_answer(response, fallback_last_number)
    if stated is None:
        return Grade(0.0, "no_answer", None, None)
    reading = read_answer(stated.text)
    if reading.kind is ReadingKind.NUMBER and gold.kind is ReadingKind.NUMBER:
        return Grade(float(readings_match(reading, gold)), "numeric", stated, reading)
    if reading.kind is ReadingKind.COMPOUND or not symbolic:
        return Grade(0.0, "ungradeable", stated, reading)
    equal = _math_verify_equal(gold_span.text, stated.text, timeout_s)
    return Grade(float(equal), "math_verify", stated, reading)


def numeric_reward(prompt: Prompt, response_text: str, fallback_last_number: bool = False) -> float:
    """1.0 if the response's stated number equals the reference's, else 0.0 (GSM8K-style).

    The reference answer may be a bare number or a full GSM8K solution ending in `#### 72`.
    Raises ValueError if the reference holds no number.
    """
    try:
        return grade(response_text, prompt.answer, fallback_last_number=fallback_last_number).score
    except ValueError as err:
        raise ValueError(f"prompt {prompt.prompt_id!r}: {err}") from None


def math_verify_reward(prompt: Prompt, response_text: str, fallback_last_number: bool = False) -> float:
    """1.0 if the response's stated answer equals the reference's, numerically where both are
    numbers and by math-verify otherwise, else 0.0. Raises ValueError if the reference cannot be
    parsed."""
    try:
        import math_verify  # noqa: F401  (named here so a missing package says how to install it)
    except ImportError:
        raise ImportError("math_verify_reward needs the math-verify package: pip install math-verify") from None
    try:
        return grade(response_text, prompt.answer, fallback_last_number=fallback_last_number, symbolic=True).score
    except ValueError as err:
        raise ValueError(f"prompt {prompt.prompt_id!r}: {err}") from None


def math_verify_alone(response: str, reference: str, timeout_s: int | None = None) -> tuple[float, str]:
    """math-verify as it is used out of the box (its own extraction over the whole response):
    the score and the answer it read, as text and value ("" when it read none)."""
    import math_verify

    answer = reference.strip()
    gold = math_verify.parse(
        answer if "\\boxed" in answer or "$" in answer else f"${answer}$", parsing_timeout=timeout_s
    )
    predicted = math_verify.parse(response, parsing_timeout=timeout_s)
    read = ""
    if predicted:  # [its value, the text it read]: both, where they differ (`1\,200` is 201 to it)
        value, text = str(predicted[0]), str(predicted[-1])
        read = text if value == text else f"{text} = {value}"
    if not gold or not predicted:
        return 0.0, read
    return float(math_verify.verify(gold, predicted, timeout_seconds=timeout_s)), read


@dataclasses.dataclass(frozen=True)
class GradedRow:
    line: int
    response: str
    reference: str
    ours: Grade
    math_verify_score: float
    math_verify_read: str


def _row_field(row: dict, field: str, where: str) -> str:
    if field not in row:
        raise ValueError(f"{where}: field {field!r} missing (fields present: {sorted(row)})")
    value = row[field]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{where}: field {field!r} is {type(value).__name__} {value!r:.60}, expected a string")
    return str(value)


def read_rows(path: str, response_field: str, answer_field: str) -> list[tuple[int, str, str]]:
    """(line number, response, reference) for each non-blank line of a JSONL file; a malformed row
    raises ValueError naming the file, the line and the field."""
    rows = []
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            rows.append((number, _row_field(row, response_field, where), _row_field(row, answer_field, where)))
    return rows


def grade_rows(
    path: str, rows: list[tuple[int, str, str]], fallback_last_number: bool, timeout_s: int
) -> list[GradedRow]:
    """Our grade and math-verify's (alone) for each row; an unusable reference names its line."""
    graded = []
    for line, response, reference in rows:
        try:
            ours = grade(
                response, reference, fallback_last_number=fallback_last_number, symbolic=True, timeout_s=timeout_s
            )
        except ValueError as err:
            raise ValueError(f"{path} line {line}: {err}") from None
        score, read = math_verify_alone(response, reference, timeout_s)
        graded.append(GradedRow(line, response, reference, ours, score, read))
    return graded


def _describe(grade_: Grade) -> str:
    if grade_.stated is None:
        return "no stated answer"
    reading = grade_.reading
    assert reading is not None
    value = f" = {reading.value}{'%' if reading.percent else ''}" if reading.value is not None else ""
    stated = f"{grade_.stated.source.value} {grade_.stated.text.strip()!r:.80}"
    return f"{stated} -> {reading.kind.value}{value}, {grade_.method}"


def summary(graded: list[GradedRow]) -> str:
    """The report the CLI prints: totals, how answers were found, and every disagreement."""
    total = len(graded)
    ours = sum(row.ours.score for row in graded)
    theirs = sum(row.math_verify_score for row in graded)
    disagree = [row for row in graded if row.ours.score != row.math_verify_score]
    sources = collections.Counter(row.ours.stated.source.value if row.ours.stated else "none" for row in graded)
    lines = [
        f"rows: {total}",
        f"ours correct: {ours:.0f}/{total}",
        f"math-verify correct: {theirs:.0f}/{total}",
        f"agree: {total - len(disagree)}, disagree: {len(disagree)}",
        "answers found by: " + ", ".join(f"{name} {count}" for name, count in sorted(sources.items())),
    ]
    for row in disagree:
        lines += [
            f"line {row.line}: ours {row.ours.score:.0f}, math-verify {row.math_verify_score:.0f}; "
            f"reference {row.reference!r:.60}",
            f"  ours: {_describe(row.ours)}",
            f"  math-verify read: {row.math_verify_read!r:.80}",
            f"  response ends: {row.response[-120:]!r}",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="a JSONL file, one row per response")
    parser.add_argument("--response_field", default="response", help="the row field holding the model's response")
    parser.add_argument("--answer_field", default="answer", help="the row field holding the reference answer")
    parser.add_argument("--fallback_last_number", action="store_true", help="grade the last number when none is stated")
    parser.add_argument("--timeout_s", type=int, default=5, help="math-verify's parse / verify timeout per row")
    args = parser.parse_args(argv)
    try:
        rows = read_rows(args.input, args.response_field, args.answer_field)
        graded = grade_rows(args.input, rows, args.fallback_last_number, args.timeout_s)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(summary(graded))
    return 0


if __name__ == "__main__":
    sys.exit(main())
