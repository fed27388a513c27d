"""make_task: each kind wired end to end, through a RewardPool where it matters."""

import json

import pytest

from dora_jax.models.tokenizer import CharTokenizer
from dora_jax.tasks import math_answers, running_sums
from dora_jax.tasks.sources import FileSource, SourceConfig
from dora_jax.tasks.task import REWARD_FUNCTIONS, TaskConfig, make_task


def test_running_sums_task_through_the_pool():
    task = make_task(TaskConfig(kind="running_sums"), CharTokenizer(running_sums.ALPHABET))
    assert task.reward_name == "running_sums" and task.reward_fn is running_sums.reward
    prompts = [task.source.next() for _ in range(20)]
    items = [(p, running_sums.demonstration(p)) for p in prompts] + [(prompts[0], "a0;0a")]
    with task.make_reward_pool(num_workers=2, timeout_s=10.0) as pool:
        results = pool.score_many(items)
    assert [r.value for r in results] == [1.0] * 20 + [0.0]
    assert all(r.ok for r in results)


def test_gsm8k_task(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text(json.dumps({"question": "what is 36 + 36", "answer": "36 + 36 = 72\n#### 72"}) + "\n")
    config = TaskConfig(kind="gsm8k", source=SourceConfig(path=str(path), chat_template=False))
    task = make_task(config, CharTokenizer("0123456789 +=whatis"))
    assert isinstance(task.source, FileSource)
    assert task.reward_fn is math_answers.numeric_reward
    prompt = task.source.next()
    assert task.reward_fn(prompt, "36 + 36 = 72\n#### 72") == 1.0
    assert task.reward_fn(prompt, "36 + 36 = \\boxed{73}") == 0.0
    assert task.reward_fn(prompt, "36 + 36 = 72") == 0.0  # no stated answer, and no fallback


def test_gsm8k_task_with_the_last_number_fallback_through_the_pool(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text(json.dumps({"question": "what is 36 + 36", "answer": "36 + 36 = 72\n#### 72"}) + "\n")
    source = SourceConfig(path=str(path), chat_template=False)
    task = make_task(
        TaskConfig(kind="gsm8k", source=source, fallback_last_number=True), CharTokenizer("0123456789 +=whatis")
    )
    prompt = task.source.next()
    items = [(prompt, "36 + 36 = 72"), (prompt, "36 + 36 = 73"), (prompt, "\\boxed{72} then 73")]
    with task.make_reward_pool(num_workers=1, timeout_s=10.0) as pool:  # the bound reward pickles
        results = pool.score_many(items)
    assert [(r.value, r.error) for r in results] == [(1.0, None), (0.0, None), (1.0, None)]


def test_math_task_uses_math_verify(tmp_path):
    import math_verify  # noqa: F401  (a core dependency: the test must run)

    path = tmp_path / "math.jsonl"
    path.write_text(json.dumps({"problem": "half", "solution": "\\frac{1}{2}"}) + "\n")
    source = SourceConfig(path=str(path), prompt_field="problem", answer_field="solution", chat_template=False)
    task = make_task(TaskConfig(kind="math", source=source), CharTokenizer("abcdefghijklmnopqrstuvwxyz"))
    assert task.reward_name == "math_verify" and task.reward_preload == ("math_verify",)
    assert task.reward_fn(task.source.next(), "so $\\boxed{0.5}$") == 1.0


def test_config_errors():
    with pytest.raises(ValueError, match="kind='mmlu'"):
        TaskConfig(kind="mmlu")
    with pytest.raises(ValueError, match="source is required for kind 'gsm8k'"):
        TaskConfig(kind="gsm8k")
    with pytest.raises(ValueError, match="reward='exact'"):
        TaskConfig(reward="exact")
    assert TaskConfig(kind="running_sums", reward="numeric").reward_name == "numeric"
    with pytest.raises(ValueError, match="fallback_last_number=True: reward 'running_sums'"):
        TaskConfig(kind="running_sums", fallback_last_number=True)
    assert TaskConfig(kind="running_sums", reward="numeric", fallback_last_number=True).fallback_last_number
    assert set(REWARD_FUNCTIONS) == {"running_sums", "numeric", "math_verify"}


def test_missing_math_verify_is_named(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "math_verify", None)
    config = TaskConfig(kind="math", source=SourceConfig(path=str(tmp_path / "x.jsonl")))
    with pytest.raises(ImportError, match="pip install math-verify"):
        make_task(config, CharTokenizer("abc"))
