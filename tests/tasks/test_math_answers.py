"""Reading and grading final answers (math_answers / answer_reading) on GSM8K- and MATH-like text,
the numeric and math-verify rewards, where ours and math-verify alone disagree, and the CLI."""

import json
import subprocess
import sys
from fractions import Fraction

import pytest

from dora_jax.tasks.answer_reading import ReadingKind, find_answer, read_answer
from dora_jax.tasks.math_answers import (
    extract_number,
    grade,
    main,
    math_verify_alone,
    math_verify_reward,
    numeric_reward,
)
from dora_jax.tasks.prompt import Prompt

GSM8K_ANSWER = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


def _prompt(answer: str) -> Prompt:
    return Prompt("row:1", "question", (1, 2, 3), answer)


def _case(response, reference, score, source, case_id):
    return pytest.param(response, reference, score, source, id=case_id)


# (response, reference, numeric reward without the fallback, where the answer was found). The first
# block is every example of issue 40, with its correct reading.
GRADE_TABLE = [
    _case("#### Step 2: ...\n9 * 2 = 18\n\\boxed{18}", "18", 1.0, "boxed", "issue-heading-then-boxed"),
    _case("#### Step 2: ...\n9 * 2 = 18\n\\boxed{18}", "2", 0.0, "boxed", "issue-heading-is-not-2"),
    _case("\\boxed{5\\text{ hours and }30\\text{ minutes}}", "5.5", 0.0, "boxed", "issue-hours-minutes-vs-5.5"),
    _case("\\boxed{5\\text{ hours and }30\\text{ minutes}}", "530", 0.0, "boxed", "issue-hours-minutes-not-530"),
    _case("\\boxed{2\\frac{1}{2}}", "2.5", 1.0, "boxed", "issue-mixed-number"),
    _case("\\boxed{2\\frac{1}{2}}", "21/2", 0.0, "boxed", "issue-mixed-number-not-21/2"),
    _case("\\boxed{\\text{12 apples}}", "12", 1.0, "boxed", "issue-text-with-words"),
    _case("\\boxed{\\textbf{12}}", "12", 1.0, "boxed", "issue-textbf"),
    _case("\\boxed{1{,}200}", "1200", 1.0, "boxed", "issue-latex-comma"),
    _case("\\boxed{12\\text{ cm}^2}", "12", 1.0, "boxed", "issue-unit-with-exponent"),
    _case("We have 2 apples and then", "2", 0.0, None, "issue-truncated"),
    _case("Let me think.\n\nAnswer: 34", "34", 1.0, "answer_line", "issue-dapo-answer-line"),
    # \boxed{}: the last complete one wins, anywhere in the response.
    _case("So the total is $48 + 24 = 72$.\n\nThe answer is $\\boxed{72}$.", GSM8K_ANSWER, 1.0, "boxed", "boxed-math"),
    _case("First \\boxed{3}, then finally \\boxed{4}", "4", 1.0, "boxed", "last-boxed"),
    _case("First \\boxed{3}, then finally \\boxed{4}", "3", 0.0, "boxed", "earlier-boxed-loses"),
    _case("The answer is \\boxed{72} or maybe 73 #### 73", "72", 1.0, "boxed", "boxed-beats-gsm8k"),
    _case("\\boxed{18}\nAnswer: 19", "18", 1.0, "boxed", "boxed-beats-answer-line"),
    _case("Final: \\boxed{18} and then \\boxed{2", "18", 1.0, "boxed", "unclosed-last-box-ignored"),
    _case("\\fbox{42}", "42", 1.0, "boxed", "fbox"),
    _case("\\boxed{\\boxed{7}}", "7", 1.0, "boxed", "nested-boxed"),
    _case("\\boxed{3, 4}", "3", 0.0, "boxed", "two-answers-in-one-box"),
    _case("\\boxed{3 \\text{ or } 4}", "3", 0.0, "boxed", "either-or-is-compound"),
    _case("\\boxed{x+1}", "1", 0.0, "boxed", "symbolic-box-numeric-task"),
    # LaTeX numbers.
    _case("\\boxed{\\frac{3}{4}}", "0.75", 1.0, "boxed", "frac"),
    _case("\\boxed{\\dfrac{-1}{2}}", "-0.5", 1.0, "boxed", "dfrac-negative"),
    _case("\\boxed{\\tfrac{7}{2}}", "3.5", 1.0, "boxed", "tfrac"),
    _case("\\boxed{\\frac12}", "0.5", 1.0, "boxed", "frac-short"),
    _case("\\boxed{-2\\frac{1}{2}}", "-2.5", 1.0, "boxed", "negative-mixed-number"),
    _case("\\boxed{2 1/2}", "2.5", 1.0, "boxed", "plain-mixed-number"),
    _case("\\boxed{1\\,200}", "1200", 1.0, "boxed", "thin-space"),
    _case("\\boxed{1\\!200}", "1200", 1.0, "boxed", "negative-thin-space"),
    _case("\\boxed{1\u2009234\u2009567}", "1234567", 1.0, "boxed", "unicode-thin-space"),
    _case("\\boxed{1,234}", "1234", 1.0, "boxed", "thousands"),
    _case("\\boxed{\u22127}", "-7", 1.0, "boxed", "unicode-minus"),
    _case("\\boxed{0.333333}", "1/3", 1.0, "boxed", "rounded-decimal"),
    _case("\\boxed{0.33}", "1/3", 0.0, "boxed", "too-rounded"),
    _case("\\boxed{1.2 \\times 10^{3}}", "1200", 1.0, "boxed", "scientific-times"),
    _case("\\boxed{2.5e-3}", "0.0025", 1.0, "boxed", "scientific-e"),
    _case("\\boxed{x = 5}", "5", 1.0, "boxed", "assignment"),
    _case("\\boxed{a = 2, b = 3}", "3", 0.0, "boxed", "two-assignments"),
    _case("\\boxed{\\left(12\\right)}", "12", 0.0, "boxed", "parenthesised-is-an-expression"),
    _case("\\boxed{2x}", "2", 0.0, "boxed", "letter-glued-is-algebra"),
    _case("\\boxed{90^\\circ}", "90", 1.0, "boxed", "degrees"),
    _case("$\\boxed{\\displaystyle 15}$", "15", 1.0, "boxed", "displaystyle"),
    # Units and words.
    _case("\\boxed{12 \\text{ m/s}^2}", "12", 1.0, "boxed", "unit-with-slash"),
    _case("\\boxed{40 \\mathrm{km}}", "40", 1.0, "boxed", "mathrm-unit"),
    _case("\\boxed{3 \\mbox{ dozen}}", "3", 1.0, "boxed", "mbox-word"),
    _case("\\boxed{18\\text{ dollars per hour}}", "18", 1.0, "boxed", "several-words"),
    _case("\\boxed{1 \\text{ hour } 30 \\text{ minutes}}", "90", 0.0, "boxed", "compound-duration"),
    # Currency and percent.
    _case("\\boxed{\\$1,200}", "1200", 1.0, "boxed", "latex-dollar"),
    _case("\\boxed{\\$12.50}", "12.5", 1.0, "boxed", "cents"),
    _case("\\boxed{-\\$5}", "-5", 1.0, "boxed", "negative-dollars"),
    _case("\\boxed{\\$-5}", "-5", 1.0, "boxed", "dollar-then-minus"),
    _case("\\boxed{£30}", "30", 1.0, "boxed", "pounds"),
    _case("\\boxed{50\\%}", "50", 1.0, "boxed", "percent-as-written"),
    _case("\\boxed{50\\%}", "0.5", 1.0, "boxed", "percent-as-fraction"),
    _case("\\boxed{25\\%}", "0.5", 0.0, "boxed", "wrong-percent"),
    _case("So 0.4 of them, that is \\boxed{40 \\text{ percent}}", "40", 1.0, "boxed", "percent-word"),
    # Answer: lines and "the answer is".
    _case("So she pays \\$1,200 in total.\n\nAnswer: \\$1,200", "1200", 1.0, "answer_line", "answer-line-dollars"),
    _case("...\nANSWER: 7", "7", 1.0, "answer_line", "answer-line-upper"),
    _case("...\n**Final Answer:** 42", "42", 1.0, "answer_line", "markdown-final-answer"),
    _case("...\nAnswer: $\\frac{3}{4}$", "3/4", 1.0, "answer_line", "answer-line-latex"),
    _case("...\nAnswer: 12 apples.", "12", 1.0, "answer_line", "answer-line-words"),
    _case("Answer: 5\nWait, let me recheck.\nAnswer: 6", "6", 1.0, "answer_line", "last-answer-line"),
    _case("Answer:\n", "0", 0.0, None, "empty-answer-line"),
    _case("Therefore, the final answer is 17.", "17", 1.0, "answer_phrase", "answer-phrase"),
    _case("The answer is $12.50. Hope that helps.", "12.5", 1.0, "answer_phrase", "answer-phrase-dollars"),
    _case("Answer: 5\nthe answer is 6", "5", 1.0, "answer_line", "answer-line-beats-phrase"),
    _case("Putting it together, the final answer: 42", "42", 1.0, "answer_phrase", "answer-colon-phrase"),
    # GSM8K ####.
    _case(GSM8K_ANSWER, GSM8K_ANSWER, 1.0, "gsm8k", "gsm8k-solution"),
    _case("She earns 10 * 3 = 30.\n#### 30", "30", 1.0, "gsm8k", "gsm8k-marker"),
    _case("#### $18", "18", 1.0, "gsm8k", "gsm8k-dollars"),
    _case("#### -12", "-12", 1.0, "gsm8k", "gsm8k-negative"),
    _case("#### 1,234", "1234", 1.0, "gsm8k", "gsm8k-thousands"),
    _case("#### 48/2 = 24", "24", 1.0, "gsm8k", "gsm8k-equation"),
    _case("#### Step 1: add\n3 + 4 = 7", "7", 0.0, None, "heading-only-no-answer"),
    _case("## Step 1\n#### Step 2: Compute 9 * 2\nResult 18\n#### 18", "18", 1.0, "gsm8k", "heading-then-marker"),
    _case("#### none", "0", 0.0, None, "gsm8k-no-number"),
    _case("#### 1. Understand\nShe has 5.\n#### 2. Solve\nSo 18 in all.", "2", 0.0, None, "numbered-headings"),
    _case("Maybe the answer is 5. Let me redo it.\n#### 7", "7", 1.0, "gsm8k", "gsm8k-beats-phrase"),
    # Truncated or answer-less responses.
    _case("Natalia sold 48/2 = 24 clips in May. Then she", "24", 0.0, None, "truncated-mid-sentence"),
    _case("She sold 24 in May, so 48 + 24 = 72 in total.", GSM8K_ANSWER, 0.0, None, "unstated-answer"),
    _case("I don't know.", GSM8K_ANSWER, 0.0, None, "no-numbers"),
    _case("The result is \\boxed{", "5", 0.0, None, "truncated-inside-box"),
]


@pytest.mark.parametrize("response, reference, score, source", GRADE_TABLE)
def test_grade_table(response, reference, score, source):
    result = grade(response, reference)
    assert result.score == score
    assert (result.stated.source.value if result.stated else None) == source
    assert numeric_reward(_prompt(reference), response) == score


def test_the_table_is_large():
    assert len(GRADE_TABLE) >= 60


@pytest.mark.parametrize(
    "response, reference, without, with_fallback",
    [
        ("We have 2 apples and then", "2", 0.0, 1.0),  # the fallback's risk, which is why it is opt-in
        ("She sold 24 in May, so 48 + 24 = 72 in total.", GSM8K_ANSWER, 0.0, 1.0),
        ("72.00", GSM8K_ANSWER, 0.0, 1.0),
        ("x = 10-3 = 7", "7", 0.0, 1.0),
        ("\\boxed{x+1} so 5", "5", 0.0, 0.0),  # a stated answer that does not read is not rescued
        ("\\boxed{5} but 6", "6", 0.0, 0.0),
    ],
)
def test_fallback_last_number(response, reference, without, with_fallback):
    assert numeric_reward(_prompt(reference), response) == without
    assert numeric_reward(_prompt(reference), response, fallback_last_number=True) == with_fallback


@pytest.mark.parametrize(
    "text, expected",
    [
        (GSM8K_ANSWER, Fraction(72)),
        ("#### 1,234", Fraction(1234)),
        ("so the answer is \\boxed{1,234}.", Fraction(1234)),
        ("\\boxed{12 \\text{ apples}}", Fraction(12)),
        ("\\boxed{\\$5}", Fraction(5)),
        ("\\boxed{\\frac{3}{4}}", Fraction(3, 4)),
        ("\\boxed{50\\%}", Fraction(50)),  # as written; the percent flag is on the Reading
        ("\\boxed{x+1}", None),
        ("\\boxed{(1,2)}", None),
        ("#### none", None),
        ("We get -5.5 dollars", None),  # nothing stated
    ],
)
def test_extract_number(text, expected):
    assert extract_number(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("We get -5.5 dollars", Fraction(-11, 2)),
        ("x = 10-3 = 7", Fraction(7)),
        ("10-3", Fraction(3)),  # subtraction, not a negative number
        ("The total is $1,000,000.", Fraction(1000000)),
        ("the value is .5", Fraction(1, 2)),
        ("3/4 of them", Fraction(3, 4)),
        ("It is 50%.", Fraction(50)),
        ("\u22127 degrees", Fraction(-7)),
        ("1,2,3", Fraction(3)),  # a list, not a thousands separator
        ("about 1{,}200 people", Fraction(1200)),
        ("no numbers here", None),
    ],
)
def test_extract_number_with_fallback(text, expected):
    assert extract_number(text, fallback_last_number=True) == expected


@pytest.mark.parametrize(
    "span, kind, value, percent",
    [
        ("5\\text{ hours and }30\\text{ minutes}", ReadingKind.COMPOUND, None, False),
        ("3 or 4", ReadingKind.COMPOUND, None, False),
        ("\\sqrt{2}", ReadingKind.EXPRESSION, None, False),
        ("(1, 2)", ReadingKind.EXPRESSION, None, False),
        ("12\\text{ cm}^2", ReadingKind.NUMBER, Fraction(12), False),
        ("50\\%", ReadingKind.NUMBER, Fraction(50), True),
        ("$-\\frac{7}{2}$", ReadingKind.NUMBER, Fraction(-7, 2), False),
        ("3\\frac{5}{4}", ReadingKind.EXPRESSION, None, False),  # not a proper mixed number
    ],
)
def test_read_answer(span, kind, value, percent):
    reading = read_answer(span)
    assert (reading.kind, reading.value, reading.percent) == (kind, value, percent)


def test_find_answer_spans():
    assert find_answer("text\nAnswer: $\\frac{3}{4}$\n").text == "$\\frac{3}{4}$"
    assert find_answer("#### Step 2: Compute\n#### 18\n").text == "18"
    assert find_answer("The answer is 5. Then 6.").text == "5"
    assert find_answer("no answer 5") is None
    assert find_answer("no answer 5", fallback_last_number=True).text == "5"


@pytest.mark.parametrize(
    "answer, response, value",
    [
        (GSM8K_ANSWER, "The answer is \\boxed{72}.", 1.0),
        ("1234", "#### 1,234", 1.0),
        ("0.3333333", "\\boxed{\\frac{1}{3}}", 1.0),
        (GSM8K_ANSWER, "She sold 24 in May, so 71 in total.", 0.0),
        (GSM8K_ANSWER, "I don't know.", 0.0),
        ("-3", "\\boxed{3}", 0.0),
        ("50\\%", "\\boxed{0.5}", 1.0),
    ],
)
def test_numeric_reward(answer, response, value):
    assert numeric_reward(_prompt(answer), response) == value


def test_numeric_reward_rejects_a_reference_without_a_number():
    with pytest.raises(ValueError, match="row:1.*no number"):
        numeric_reward(_prompt("seventy-two"), "72")


@pytest.mark.parametrize(
    "answer, response, value",
    [
        ("\\frac{1}{2}", "So $x = \\boxed{0.5}$.", 1.0),
        ("\\sqrt{2}", "Thus the side is $\\boxed{\\sqrt{2}}$.", 1.0),
        ("34", "The answer is 34", 1.0),
        ("(1,2)", "The point is \\boxed{(1, 2)}", 1.0),
        ("x^2+2x+1", "Expanding, $\\boxed{(x+1)^2}$", 1.0),
        ("\\boxed{\\frac{\\pi}{3}}", "The angle is $\\boxed{\\frac{\\pi}{3}}$", 1.0),
        ("\\sqrt{2}", "Thus \\boxed{2}", 0.0),
        ("34", "gibberish", 0.0),
        ("5", "\\boxed{\\sqrt{25}}", 1.0),  # an expression against a number: math-verify decides
        ("2", "\\boxed{2x}", 0.0),
        ("5", "\\boxed{5\\text{ hours and }30\\text{ minutes}}", 0.0),  # compound: never to math-verify
        ("\\frac{\\sqrt{3}}{2}", "Answer: $\\frac{\\sqrt{3}}{2}$", 1.0),
        ("2", "We have 2 apples and then", 0.0),
    ],
)
def test_math_verify_reward(answer, response, value):
    import math_verify  # noqa: F401  (a core dependency: the test must run)

    assert math_verify_reward(_prompt(answer), response) == value


def test_math_verify_reward_with_fallback():
    import math_verify  # noqa: F401  (a core dependency: the test must run)

    assert math_verify_reward(_prompt("2"), "We have 2 apples and then", fallback_last_number=True) == 1.0


def test_math_verify_reward_rejects_an_unparseable_reference():
    import math_verify  # noqa: F401  (a core dependency: the test must run)

    with pytest.raises(ValueError, match="row:1.*cannot parse"):
        math_verify_reward(_prompt("$$"), "\\boxed{x}")


# Where our grade and math-verify alone (its own extraction over the whole response) differ, and
# what math-verify reads: docs/grading.md lists these.
DISAGREEMENTS = [
    ("\\boxed{5\\text{ hours and }30\\text{ minutes}}", "5", 0.0, 1.0, "5"),
    ("\\boxed{1\\,200}", "1200", 1.0, 0.0, "1\\,200 = 201"),  # its thin space is a product
    ("\\boxed{\\text{12 apples}}", "12", 1.0, 0.0, "\\text{12 apples} = 12apples"),
    ("We have 2 apples and then", "2", 0.0, 1.0, "2"),
    ("\\boxed{3} or \\boxed{4}", "4", 1.0, 0.0, "3,4 = {3, 4}"),  # every box, as a set
    ("\\boxed{2 1/2}", "2.5", 1.0, 0.0, "2 1/2 = 3/2"),
    ("So she pays \\$1,200 in total.\n\nAnswer: \\$1,200", "1200", 1.0, 0.0, ""),
]


@pytest.mark.parametrize("response, reference, ours, theirs, theirs_read", DISAGREEMENTS)
def test_known_disagreements_with_math_verify(response, reference, ours, theirs, theirs_read):
    import math_verify  # noqa: F401  (a core dependency: the test must run)

    assert grade(response, reference, symbolic=True).score == ours
    assert math_verify_alone(response, reference) == (theirs, theirs_read)


def _write_rows(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))


def test_cli_grades_a_file_and_lists_disagreements(tmp_path, capsys):
    import math_verify  # noqa: F401  (a core dependency: the test must run)

    path = tmp_path / "rows.jsonl"
    _write_rows(
        path,
        [
            {"response": "\\boxed{18}", "answer": "18"},
            {"response": "We have 2 apples and then", "answer": 2},
            "",
            {"response": "\\boxed{1\\,200}", "answer": "1200"},
            {"response": "Answer: \\frac{1}{2}", "answer": "0.5"},
        ],
    )
    assert main([f"--input={path}"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:5] == [
        "rows: 4",
        "ours correct: 3/4",
        "math-verify correct: 3/4",
        "agree: 2, disagree: 2",
        "answers found by: answer_line 1, boxed 2, none 1",
    ]
    assert out[5] == "line 2: ours 0, math-verify 1; reference '2'"
    assert out[6] == "  ours: no stated answer"
    assert out[9] == "line 4: ours 1, math-verify 0; reference '1200'"
    assert out[10] == "  ours: boxed '1\\\\,200' -> number = 1200, numeric"
    assert out[11] == "  math-verify read: '1\\\\,200 = 201'"
    assert len(out) == 13
    assert main([f"--input={path}", "--fallback_last_number"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "ours correct: 4/4"


@pytest.mark.parametrize(
    "row, message",
    [
        ('{"response": "\\\\boxed{1}", "answer": "1"', "line 2: not valid JSON"),
        ('["\\\\boxed{1}", "1"]', "line 2: expected a JSON object, got list"),
        (
            {"text": "\\boxed{1}", "answer": "1"},
            "line 2: field 'response' missing \\(fields present: \\['answer', 'text'\\]",
        ),
        ({"response": "\\boxed{1}", "answer": None}, "line 2: field 'answer' is NoneType None, expected a string"),
        ({"response": "\\boxed{1}", "answer": "$$"}, "line 2: math-verify cannot parse the reference answer"),
    ],
)
def test_cli_names_a_malformed_row(tmp_path, capsys, row, message):
    import math_verify  # noqa: F401  (a core dependency: the test must run)

    path = tmp_path / "rows.jsonl"
    _write_rows(path, [{"response": "\\boxed{1}", "answer": "1"}, row])
    assert main([f"--input={path}"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"error: {path} line 2")
    assert __import__("re").search(message, captured.err)


def test_cli_runs_as_a_module(tmp_path):
    path = tmp_path / "rows.jsonl"
    _write_rows(path, [{"resp": "#### 7", "gold": "7"}])
    command = [sys.executable, "-m", "dora_jax.tasks.math_answers", f"--input={path}"]
    done = subprocess.run([*command, "--response_field=resp", "--answer_field=gold"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[:2] == ["rows: 1", "ours correct: 1/1"]
    missing = subprocess.run([*command, "--answer_field=gold"], capture_output=True, text=True)
    assert missing.returncode == 2
    assert "line 1: field 'response' missing" in missing.stderr
