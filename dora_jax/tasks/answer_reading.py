"""Reading the final answer out of a model's response the way a person grading it would.

`find_answer(text, fallback_last_number)` picks the stated answer, in this order:
1. the content of the last complete `\\boxed{...}` / `\\fbox{...}` (braces balanced),
2. the last `Answer: ...` line (DAPO-Math's form; `**Final Answer:**` too, any case),
3. the rest of the line after the last GSM8K `####`, only when a number follows the marker
   (`#### Step 2: ...` and `#### 1. Set up` are Markdown headings, not answers),
4. the last "the (final) answer is ..." / "answer: ..." phrase inside a line, to the end of its
   sentence (a statement a person reads as the answer, though not in one of the forms above),
5. only with `fallback_last_number`: the last number anywhere in the text.
The first form present decides: a stated answer that does not read is not rescued by a later one.

`read_answer(span)` then reads that span as one number where it is one:
- `\\text{}`, `\\textbf{}`, `\\textit{}`, `\\mathrm{}`, `\\mathbf{}`, `\\mbox{}` are unwrapped with their
  spacing kept (the content is set off by spaces, so `5\\text{ hours and }30` never reads 530);
- `{,}`, `\\,`, `\\!` and unicode thin / no-break spaces between digits are removed (`1{,}200` is 1200),
  a comma groups thousands only in groups of three (`1,2,3` is a list);
- `$...$`, `\\(...\\)`, `\\[...\\]`, `**bold**`, a trailing full stop and a leading `x =` are dropped;
  of `a = b = c` the last side is read (not when a middle side holds a letter: `a = 2, b = 3`);
- currency before the number (`\\$`, `$`, `£`, `€`, `¥`), a sign before or after it, the unicode minus;
- `\\frac{a}{b}` / `\\dfrac` / `\\tfrac` / `\\frac12`, `a/b`, mixed numbers (`2\\frac{1}{2}` and `2 1/2`
  are 5/2), decimals, `1.2e3` and `1.2 \\times 10^{3}`;
- a trailing `%` / `\\%` / `percent` marks a percentage (read as written: `50\\%` is 50, flagged);
- units and words after the number are dropped when set off by a space (`12\\text{ cm}^2` is 12,
  `\\text{12 apples}` is 12, `90^\\circ` is 90); a letter glued to the number is algebra (`2x`).
A span with a second number after words (`5 hours and 30 minutes`, `3 or 4`) is COMPOUND: no single
value, ungradeable. Anything else that is not one number (`\\sqrt{2}`, `(1, 2)`, `x+1`) is an
EXPRESSION, for math-verify to judge where the task uses it.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from fractions import Fraction


class AnswerSource(enum.Enum):
    BOXED = "boxed"
    ANSWER_LINE = "answer_line"
    ANSWER_PHRASE = "answer_phrase"
    GSM8K = "gsm8k"
    LAST_NUMBER = "last_number"
    WHOLE = "whole"  # a bare reference answer: the whole text is the answer


class ReadingKind(enum.Enum):
    NUMBER = "number"
    COMPOUND = "compound"  # several numbers with words between: no single value
    EXPRESSION = "expression"  # symbolic, a tuple, a set, ...: math-verify's domain


@dataclasses.dataclass(frozen=True)
class StatedAnswer:
    """The span of a response that states its answer, and which form stated it."""

    text: str
    source: AnswerSource


@dataclasses.dataclass(frozen=True)
class Reading:
    """What a stated answer reads as; `value` only for a NUMBER (a percentage as written: 50)."""

    kind: ReadingKind
    value: Fraction | None = None
    percent: bool = False


_NUMBER = (
    r"(?:(?<![\w)\]}])-)?"  # a minus sign, unless it reads as subtraction (5-3)
    r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
)
_UNSIGNED = r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d*)?|\.\d+)"
_FRACTION_RE = re.compile(r"\\[dt]?frac\{\s*(" + _NUMBER + r")\s*\}\{\s*(" + _NUMBER + r")\s*\}")
_SHORT_FRACTION_RE = re.compile(r"\\[dt]?frac\s*(\d)\s*(\d)")  # \frac12
_NUMBER_RE = re.compile(r"(" + _NUMBER + r")(?:\s*/\s*(" + _NUMBER + r"))?")
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_WRAPPER_RE = re.compile(r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mathit|mbox|operatorname)\s*\{")
_ANSWER_LINE_RE = re.compile(r"^[ \t>#*_-]*(?:final[ \t]+)?answer[ \t*_]*[:：][ \t*_]*(.*?)[ \t]*$", re.I | re.M)
_ANSWER_PHRASE_RE = re.compile(r"\b(?:final\s+)?answer(?:\s+is\s*:?|\s*:)\s*([^\n]*)", re.I)
# `####` then a number: digits, a sign, currency, a decimal point or a LaTeX fraction; not a
# numbered Markdown heading (`#### 1. Understand the problem`).
_GSM8K_RE = re.compile(
    r"####(?![ \t]*\d+[.)][ \t]+\S*[A-Za-z])[ \t]*((?:[-+\u2212]|\\?\$)*[ \t]*(?:\d|\.\d|\\[dt]?frac)[^\n]*)"
)
# Spaces inside a number: `{,}` stands for a comma, thin spaces and `\!` join digit groups.
_DIGIT_GAP_RE = re.compile(r"(?<=\d)(?:\\[,!;: ]|[\u2009\u202f\u00a0]|~)(?=\d)")
_SPACING_RE = re.compile(r"\\[,;: ]|\\q?quad\b|~|[\u2009\u202f\u00a0]")
_DROPPED_RE = re.compile(r"\\!|\\(?:left|right|displaystyle)\b|\*\*|__|\^\s*\{?\s*\\circ\s*\}?|\\degree\b|°")
_SIDE_SEPARATOR_RE = re.compile(r"=|\\approx|\\equiv|\s+is\s+")
_ASSIGNMENT_RE = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?\s*:?=\s*")
_SIGN_CURRENCY_RE = re.compile(r"\s*([-+\u2212]?)\s*(?:\\\$|\$|£|€|¥)?\s*([-+\u2212]?)\s*")
_MIXED_FRACTION_RE = re.compile(
    r"(\d+)\s*\\[dt]?frac\s*\{\s*(\d+)\s*\}\s*\{\s*(\d+)\s*\}|(\d+)\s+(\d+)\s*/\s*(\d+)(?!\d)"
)
_SIGNED = r"[-+]?\s*" + _UNSIGNED
_LATEX_FRACTION_RE = re.compile(
    r"\\[dt]?frac\s*(?:\{\s*(" + _SIGNED + r")\s*\}\s*\{\s*(" + _SIGNED + r")\s*\}|(\d)(\d))"
)
_TIMES_TEN_TO = r"\s*(?:\\times|\\cdot|×|\*)\s*10\s*\^\s*\{?\s*([-+\u2212]?\d+)\s*\}?"  # 1.2 \times 10^{3}
_PLAIN_RE = re.compile(r"(" + _UNSIGNED + r")(?:[eE]([-+]?\d+)|" + _TIMES_TEN_TO + r"|\s*/\s*(" + _UNSIGNED + r"))?")
_PERCENT_RE = re.compile(r"\s*(?:\\%|%|percent\b)")
_EXPONENT_RE = re.compile(r"\^\s*(?:\{[^{}]*\}|-?\d+)")


def braced_content(text: str, start: int) -> tuple[str, int] | None:
    """The text from `start` (just past an opening brace) to its matching close, and the index
    after that close; None if the braces never balance (a truncated response)."""
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i], i + 1
    return None


def boxed_contents(text: str) -> list[str]:
    """The contents of every complete `\\boxed{...}` / `\\fbox{...}` in text, braces balanced."""
    contents = []
    for match in _BOXED_RE.finditer(text):
        found = braced_content(text, match.end())
        if found is not None:
            contents.append(found[0])
    return contents


def _first_sentence(text: str) -> str:
    """Text up to the first full stop that ends a sentence (not a decimal point)."""
    return re.split(r"\.(?=\s|$)", text, maxsplit=1)[0]


def find_answer(text: str, fallback_last_number: bool = False) -> StatedAnswer | None:
    """The span where `text` states its final answer (module docstring's order), or None."""
    boxed = boxed_contents(text)
    if boxed:
        return StatedAnswer(boxed[-1], AnswerSource.BOXED)
    lines = [m.group(1) for m in _ANSWER_LINE_RE.finditer(text) if m.group(1).strip()]
    if lines:
        return StatedAnswer(lines[-1], AnswerSource.ANSWER_LINE)
    markers = _GSM8K_RE.findall(text)
    if markers:
        return StatedAnswer(markers[-1], AnswerSource.GSM8K)
    phrases = [_first_sentence(m.group(1)) for m in _ANSWER_PHRASE_RE.finditer(text)]
    phrases = [p for p in phrases if p.strip()]
    if phrases:
        return StatedAnswer(phrases[-1], AnswerSource.ANSWER_PHRASE)
    if fallback_last_number:
        numbers = numbers_in(text)
        if numbers:
            return StatedAnswer(str(numbers[-1]), AnswerSource.LAST_NUMBER)
    return None


def numbers_in(text: str) -> list[Fraction]:
    """Every number in free text, left to right; `\\frac{a}{b}` and `a/b` become one fraction."""
    text = _DIGIT_GAP_RE.sub("", text.replace("{,}", ",").replace("\u2212", "-"))
    text = _FRACTION_RE.sub(lambda m: f"{m.group(1)}/{m.group(2)}", text)
    text = _SHORT_FRACTION_RE.sub(lambda m: f"{m.group(1)}/{m.group(2)}", text)
    values = []
    for match in _NUMBER_RE.finditer(text):
        value = Fraction(match.group(1).replace(",", ""))
        if match.group(2) is not None:
            denominator = Fraction(match.group(2).replace(",", ""))
            if denominator == 0:
                continue
            value /= denominator
        values.append(value)
    return values


def _unwrap_text(span: str) -> str:
    """`\\text{ cm}` -> `  cm `: each wrapper's content set off by spaces, nested ones too."""
    while (match := _WRAPPER_RE.search(span)) is not None:
        found = braced_content(span, match.end())
        if found is None:
            return span[: match.start()] + " " + span[match.end() :]
        content, end = found
        span = f"{span[: match.start()]} {content} {span[end:]}"
    return span


def _strip_delimiters(span: str) -> str:
    span = span.strip().rstrip(".").strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(span) > len(left) + len(right) and span.startswith(left) and span.endswith(right):
            return span[len(left) : -len(right)].strip()
    return span


def normalise(span: str) -> str:
    """The span with LaTeX wrappers, spacing, delimiters and a leading `x =` taken away."""
    span = _unwrap_text(span).replace("{,}", ",").replace("\u2212", "-")
    span = _DIGIT_GAP_RE.sub("", span)
    span = _DROPPED_RE.sub("", _SPACING_RE.sub(" ", span))
    span = _strip_delimiters(span)
    sides = _SIDE_SEPARATOR_RE.split(span)
    # `48/2 = 24` reads 24, but `a = 2, b = 3` is not `3`: a middle side holding a letter ends the chain.
    if len(sides) > 1 and sides[-1].strip() and not any(re.search("[A-Za-z]", side) for side in sides[1:-1]):
        span = sides[-1]
    span = _strip_delimiters(_ASSIGNMENT_RE.sub("", span.strip()))
    return span.strip()


def _magnitude(span: str) -> tuple[Fraction, int] | None:
    """The unsigned number at the start of span and where it ends, or None."""
    if (m := _MIXED_FRACTION_RE.match(span)) is not None:
        whole, numerator, denominator = (m.group(1), m.group(2), m.group(3)) if m.group(1) else m.group(4, 5, 6)
        if int(denominator) != 0 and int(numerator) < int(denominator):
            return Fraction(int(whole)) + Fraction(int(numerator), int(denominator)), m.end()
    if (m := _LATEX_FRACTION_RE.match(span)) is not None:
        numerator, denominator = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        numerator_value, denominator_value = (Fraction(re.sub(r"[,\s]", "", n)) for n in (numerator, denominator))
        return (numerator_value / denominator_value, m.end()) if denominator_value else None
    if (m := _PLAIN_RE.match(span)) is not None:
        value = Fraction(m.group(1).replace(",", ""))
        if m.group(2) or m.group(3):
            value *= Fraction(10) ** int((m.group(2) or m.group(3)).replace("\u2212", "-"))
        if m.group(4):
            denominator = Fraction(m.group(4).replace(",", ""))
            if denominator == 0:
                return None
            value /= denominator
        return value, m.end()
    return None


def read_answer(span: str) -> Reading:
    """A stated answer read as one number where it is one (module docstring), else its kind."""
    text = normalise(span)
    prefix = _SIGN_CURRENCY_RE.match(text)
    assert prefix is not None  # every part of it is optional
    signs = (prefix.group(1) + prefix.group(2)).replace("\u2212", "-")
    rest = text[prefix.end() :]
    found = _magnitude(rest)
    if found is None or len(signs) > 1:
        return Reading(ReadingKind.COMPOUND if _is_compound(text) else ReadingKind.EXPRESSION)
    value, end = found
    value = -value if signs == "-" else value
    rest = rest[end:]
    percent = _PERCENT_RE.match(rest)
    if percent is not None:
        rest = rest[percent.end() :]
    tail = rest.strip()
    if not tail:
        return Reading(ReadingKind.NUMBER, value, percent is not None)
    words_after_gap = rest[0].isspace() and (tail[0].isalpha() or tail[0] in "\\/")
    if words_after_gap and not re.search(r"\d", _EXPONENT_RE.sub("", tail)):
        return Reading(ReadingKind.NUMBER, value, percent is not None)  # units and words dropped
    return Reading(ReadingKind.COMPOUND if _is_compound(text) else ReadingKind.EXPRESSION)


def _is_compound(text: str) -> bool:
    """Two or more numbers with a word (two letters or more) between them: `5 hours and 30 minutes`."""
    plain = re.sub(r"\\[A-Za-z]+", " ", _EXPONENT_RE.sub("", text))  # `\frac` is not a word
    between_numbers = re.split(r"\d+", plain)[1:-1]
    return any(re.search(r"[A-Za-z]{2,}", piece) for piece in between_numbers)
