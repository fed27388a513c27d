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
    prompt = _prompt([3, 1, 4, 1, 5])
    assert prompt.text == "a3b1c4d1e5="
    assert prompt.answer == "4"
    assert rs.demonstration(prompt) == "a3b4c8d9e4;4"
    assert rs.reward(prompt, "a3b4c8d9e4;4") == 1.0
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


@pytest.mark.parametrize(
    "response",
    [
        "a3b4c8d9e5;5",  # wrong final answer
        "a3b4c8d9e4;5",  # right last sum, wrong answer
        "a3b4c8d9e4",  # no answer
        "a3b4c8d9;9",  # one step short
        "a3b4c8d9e4f4;4",  # one step too many
        "a3b4c8e9d4;4",  # tags out of order
        "a3b4c8d9e4;04",  # not canonical
        "a3b4c8d9e4;4;4",  # trailing garbage
        "3,4,8,9,4;4",  # other format
        ";4",
        "",
    ],
)
def test_corruptions_score_zero(response):
    assert rs.reward(_prompt([3, 1, 4, 1, 5]), response) == 0.0


def test_only_the_final_answer_is_graded():
    assert rs.reward(_prompt([3, 1, 4, 1, 5]), "a0b0c0d0e0;4") == 1.0


def test_malformed_prompt_raises():
    with pytest.raises(ValueError, match="not a running-sums prompt"):
        rs.reward(Prompt("p", "hello", (), "4"), "a4;4")


def test_modulus_100():
    prompt = _prompt([9, 9, 9, 9, 9], modulus=100)
    assert rs.demonstration(prompt) == "a9b18c27d36e45;45"
    assert rs.reward(prompt, "a9b18c27d36e45;45") == 1.0
    assert rs.reward(prompt, "a9b18c27d36e45;5") == 0.0


def test_length_distribution_is_long_tailed():
    stats = rs.length_stats(rs.RunningSumsConfig(), 5000)
    assert stats["median"] == 9.0
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
    with pytest.raises(ValueError, match="alphabet"):
        rs.RunningSumsSource(rs.RunningSumsConfig(), CharTokenizer("0123456789"))


def test_k_is_clipped():
    config = rs.RunningSumsConfig(median_k=40, sigma=2.0, k_max=10)
    ks = [rs.sample_k(np.random.default_rng(i), config) for i in range(200)]
    assert 1 <= min(ks) and max(ks) == 10
