"""Final-answer extraction and the numeric / math-verify rewards on GSM8K- and MATH-like text."""

from fractions import Fraction

import pytest

from dora_jax.tasks.math_answers import extract_number, math_verify_reward, numeric_reward
from dora_jax.tasks.prompt import Prompt

GSM8K_ANSWER = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


def _prompt(answer: str) -> Prompt:
    return Prompt("row:1", "question", (1, 2, 3), answer)


@pytest.mark.parametrize(
    "text, expected",
    [
        (GSM8K_ANSWER, Fraction(72)),
        ("#### 1,234", Fraction(1234)),
        ("#### $18", Fraction(18)),
        ("#### -12", Fraction(-12)),
        ("so the answer is \\boxed{1,234}.", Fraction(1234)),
        ("\\boxed{12 \\text{ apples}}", Fraction(12)),
        ("\\boxed{\\$5}", Fraction(5)),
        ("\\boxed{\\frac{3}{4}}", Fraction(3, 4)),
        ("\\boxed{\\dfrac{-1}{2}}", Fraction(-1, 2)),
        ("First \\boxed{3}, then finally \\boxed{4}", Fraction(4)),
        ("We get -5.5 dollars", Fraction(-11, 2)),
        ("x = 10-3 = 7", Fraction(7)),
        ("10-3", Fraction(3)),  # subtraction, not a negative number
        ("The total is $1,000,000.", Fraction(1000000)),
        ("the value is .5", Fraction(1, 2)),
        ("3/4 of them", Fraction(3, 4)),
        ("It is 50%.", Fraction(50)),
        ("\u22127 degrees", Fraction(-7)),
        ("1,2,3", Fraction(3)),  # a list, not a thousands separator
        ("no numbers here", None),
        ("\\boxed{x+1}", None),  # symbolic boxed answer
        ("\\boxed{(1,2)}", None),
        ("#### none", None),
    ],
)
def test_extract_number(text, expected):
    assert extract_number(text) == expected


@pytest.mark.parametrize(
    "answer, response, value",
    [
        (GSM8K_ANSWER, "She sold 24 in May, so 48 + 24 = 72 in total.", 1.0),
        (GSM8K_ANSWER, "The answer is \\boxed{72}.", 1.0),
        (GSM8K_ANSWER, "72.00", 1.0),
        ("1234", "#### 1,234", 1.0),
        ("0.3333333", "\\boxed{\\frac{1}{3}}", 1.0),
        (GSM8K_ANSWER, "She sold 24 in May, so 71 in total.", 0.0),
        (GSM8K_ANSWER, "The answer is \\boxed{72} or maybe 73 #### 73", 0.0),
        (GSM8K_ANSWER, "I don't know.", 0.0),
        ("-3", "3", 0.0),
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
    ],
)
def test_math_verify_reward(answer, response, value):
    import math_verify  # noqa: F401  (a core dependency: the test must run)

    assert math_verify_reward(_prompt(answer), response) == value


def test_math_verify_reward_rejects_an_unparseable_reference():
    import math_verify  # noqa: F401  (a core dependency: the test must run)

    with pytest.raises(ValueError, match="row:1.*cannot parse"):
        math_verify_reward(_prompt("$$"), "\\boxed{1}")
