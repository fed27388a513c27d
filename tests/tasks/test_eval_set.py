"""Held-out evaluation prompts: disjoint draws for running_sums, held-out rows or an eval file for
file tasks, leaks counted, bad eval files named."""

import itertools
import json
import string

import pytest

from dora_jax.models.tokenizer import CharTokenizer
from dora_jax.tasks import running_sums
from dora_jax.tasks.eval_set import LeakCounter, eval_prompts
from dora_jax.tasks.sources import SourceConfig
from dora_jax.tasks.task import TaskConfig, make_task

CHARS = CharTokenizer(string.ascii_letters + string.digits + " ?.+=#\n")


def _good_rows(n):
    return [{"question": f"what is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(n)]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _file_task(path, hold_out=0):
    config = TaskConfig(kind="gsm8k", source=SourceConfig(path=path, chat_template=False, hold_out=hold_out))
    return config, make_task(config, CHARS)


def test_running_sums_eval_prompts_are_draws_training_never_makes():
    tokenizer = CharTokenizer(running_sums.ALPHABET)
    config = TaskConfig(running_sums=running_sums.RunningSumsConfig(median_k=6, k_max=40))
    task = make_task(config, tokenizer)
    held = eval_prompts(config, task, tokenizer, 64)
    assert len(held) == 64 and all(p.prompt_id.startswith("eval/running_sums/0/eval") for p in held)
    train = [task.source.next() for _ in range(2000)]
    # Another stream of the same distribution: the long prompts (3^k strings) never coincide.
    long_train = {p.text for p in train if p.metadata["k"] >= 8}
    long_held = [p for p in held if p.metadata["k"] >= 8]
    assert long_held and not long_train & {p.text for p in long_held}
    assert held == eval_prompts(config, task, tokenizer, 64)  # deterministic
    with pytest.raises(ValueError, match="eval.path='x.jsonl': task.kind 'running_sums'"):
        eval_prompts(config, task, tokenizer, 4, "x.jsonl")


def test_a_file_task_holds_out_its_last_rows_and_never_trains_on_them(tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", _good_rows(20))
    config, task = _file_task(path, hold_out=5)
    held = eval_prompts(config, task, CHARS, 5)
    assert [p.prompt_id for p in held] == [f"eval/train.jsonl:{i}" for i in range(15, 20)]
    drawn = {p.prompt_id for p in itertools.islice(task.source, 60)}  # four epochs
    assert drawn == {f"train.jsonl:{i}" for i in range(15)}
    state = task.source.state()
    assert state["hold_out"] == 5
    _, other = _file_task(path, hold_out=3)
    with pytest.raises(ValueError, match="hold_out is 5 in the state but 3 here"):
        other.source.restore(state)
    with pytest.raises(ValueError, match="all held out for evaluation"):
        _file_task(path, hold_out=20)


def test_an_eval_file_and_its_errors(tmp_path):
    train = _write_jsonl(tmp_path / "train.jsonl", _good_rows(10))
    test = _write_jsonl(tmp_path / "test.jsonl", _good_rows(4))
    config, task = _file_task(train)
    held = eval_prompts(config, task, CHARS, 4, test)
    assert [p.prompt_id for p in held] == [f"eval/test.jsonl:{i}" for i in range(4)]
    with pytest.raises(ValueError, match=r"eval.path='.*test.jsonl' has 4 usable prompts .*eval.num_prompts=6"):
        eval_prompts(config, task, CHARS, 6, test)
    with pytest.raises(ValueError, match=r"eval.path='.*missing.jsonl'"):
        eval_prompts(config, task, CHARS, 2, str(tmp_path / "missing.jsonl"))
    wrong = _write_jsonl(tmp_path / "wrong.jsonl", [{"q": "what is 1?", "answer": "1"}] * 4)
    with pytest.raises(ValueError, match=r"eval.path='.*wrong.jsonl'.*missing field 'question'"):
        eval_prompts(config, task, CHARS, 2, wrong)
    # The same questions in both files: every training draw of one is a counted leak.
    leaks = LeakCounter(held)
    for prompt in itertools.islice(task.source, 10):
        leaks.check(prompt)
    assert leaks.leaked == 4 and leaks.eval_prompts_seen_in_training == 4
