"""Running sums: format, exact rewards, determinism, and the long-tailed length distribution."""

import json

import numpy as np
import pytest

from dora_jax.models.tokenizer import CharTokenizer
from dora_jax.tasks import running_sums as rs
from dora_jax.tasks.prompt import Prompt

TOKENIZER = CharTokenizer(rs.ALPHABET)


def _prompt(terms, modulus=10):
    text = rs.prompt_text(terms)
    answer = str(rs.running_sums(terms, modulus)[-1])
    return Prompt("p", text, tuple(TOKENIZER.encode(text, True)), answer, {"k": len(terms), "modulus": modulus})


def test_worked_example():
    prompt = _prompt([2, 1, 2, 0, 1])
    assert prompt.text == "a2b1c2d0e1="
    assert prompt.answer == "6"
    assert rs.demonstration(prompt) == "a22b13c25d05e16;6"
    assert rs.reward(prompt, "a22b13c25d05e16;6") == 1.0
    wraps = _prompt([3, 1, 4, 1, 5])  # terms up to 9 are valid prompts; sums wrap mod 10
    assert rs.demonstration(wraps) == "a33b14c48d19e54;4"
    assert TOKENIZER.vocab_size == 67
    assert prompt.prompt_ids[0] == CharTokenizer.BOS


def test_demonstrations_score_one_and_tokenize():
    source = rs.RunningSumsSource(rs.RunningSumsConfig(seed=3), TOKENIZER)
    ks = set()
    for _ in range(400):
        prompt = source.next()
        response = rs.demonstration(prompt)
        assert rs.reward(prompt, response) == 1.0
        ids = TOKENIZER.encode(response) + [CharTokenizer.EOS]
        assert len(ids) == rs.response_length(prompt.metadata["k"])
        assert TOKENIZER.decode(ids) == response
        assert TOKENIZER.decode(prompt.prompt_ids) == prompt.text
        ks.add(prompt.metadata["k"])
    assert min(ks) == 1 and max(ks) >= 20
    assert {t for p in [source.prompt(i) for i in range(50)] for t in rs.parse_terms(p.text)} == {0, 1, 2}


@pytest.mark.parametrize(
    "response",
    [
        "a22b13c25d05e17;7",  # wrong final answer
        "a22b13c25d05e16;7",  # right last sum, wrong answer
        "a22b13c25d05e16",  # no answer
        "a22b13c25d05;5",  # one step short
        "a22b13c25d05e16f06;6",  # one step too many
        "a22b13c25e05d16;6",  # tags out of order
        "a2b3c5d5e6;6",  # sums without the terms (the old format)
        "a22b13c25d05e1;6",  # a step without its sum
        "a22b13c25d05e16;06",  # not canonical
        "a22b13c25d05e16;6;6",  # trailing garbage
        "2,3,5,5,6;6",  # other format
        ";6",
        "",
    ],
)
def test_corruptions_score_zero(response):
    assert rs.reward(_prompt([2, 1, 2, 0, 1]), response) == 0.0


def test_only_the_final_answer_is_graded():
    assert rs.reward(_prompt([2, 1, 2, 0, 1]), "a00b00c00d00e00;6") == 1.0


def test_malformed_prompt_raises():
    with pytest.raises(ValueError, match="not a running-sums prompt"):
        rs.reward(Prompt("p", "hello", (), "4"), "a4;4")


def test_modulus_100():
    prompt = _prompt([9, 9, 9, 9, 9], modulus=100)
    assert rs.demonstration(prompt) == "a99b918c927d936e945;45"
    assert rs.reward(prompt, "a99b918c927d936e945;45") == 1.0
    assert rs.reward(prompt, "a99b918c927d936e945;5") == 0.0


def test_length_distribution_is_long_tailed():
    stats = rs.length_stats(rs.RunningSumsConfig(), 5000)
    assert stats["median"] == 12.0  # k = 3: 3 x 3 + 2 characters and EOS
    assert stats["max"] >= 10 * stats["median"]
    assert stats["p99"] > 4 * stats["median"]


def test_source_is_deterministic_and_resumable():
    config = rs.RunningSumsConfig(seed=7)
    a, b = rs.RunningSumsSource(config, TOKENIZER), rs.RunningSumsSource(config, TOKENIZER)
    first = [a.next() for _ in range(20)]
    assert first == [b.next() for _ in range(20)]
    assert len({p.prompt_id for p in first}) == 20
    other = rs.RunningSumsSource(rs.RunningSumsConfig(seed=8), TOKENIZER)
    assert [p.text for p in first] != [other.next().text for _ in range(20)]
    state = json.loads(json.dumps(a.state()))
    expected = [a.next() for _ in range(5)]
    resumed = rs.RunningSumsSource(config, TOKENIZER)
    resumed.restore(state)
    assert [resumed.next() for _ in range(5)] == expected
    with pytest.raises(ValueError, match="cannot restore"):
        other.restore(state)


def test_config_and_tokenizer_errors():
    with pytest.raises(ValueError, match="k_max"):
        rs.RunningSumsConfig(k_max=60)
    with pytest.raises(ValueError, match="modulus"):
        rs.RunningSumsConfig(modulus=1)
    with pytest.raises(ValueError, match="max_term"):
        rs.RunningSumsConfig(max_term=10)
    with pytest.raises(ValueError, match="alphabet"):
        rs.RunningSumsSource(rs.RunningSumsConfig(), CharTokenizer("0123456789"))


def test_k_is_clipped():
    config = rs.RunningSumsConfig(median_k=40, sigma=2.0, k_max=10)
    ks = [rs.sample_k(np.random.default_rng(i), config) for i in range(200)]
    assert 1 <= min(ks) and max(ks) == 10
