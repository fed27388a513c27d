"""FileSource on small JSONL / Parquet / HF-disk files made here: mapping, skips, order, resume."""

import collections
import json
import string

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from dora_jax.models.tokenizer import CharTokenizer, HFTokenizer
from dora_jax.tasks.sources import FileSource, SourceConfig

CHARS = CharTokenizer(string.ascii_letters + string.digits + " ?.+=#\n")
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _good_rows(n):
    return [{"question": f"what is {i} + {i}?", "answer": f"#### {2 * i}", "id": f"q{i}"} for i in range(n)]


def _write_jsonl(path, rows, extra_lines=()):
    lines = [json.dumps(r) for r in rows] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _plain(path, **kwargs):
    return SourceConfig(path=path, chat_template=False, **kwargs)


@pytest.fixture()
def hf_tokenizer(tmp_path):
    words = ["what", "is", "?", "+", "be", "brief", *map(str, range(40))]
    vocab = {
        w: i for i, w in enumerate(["<unk>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", "\n", *words])
    }
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    directory = tmp_path / "tok"
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|im_end|>"}))
    return HFTokenizer(str(directory))


def test_jsonl_plain_text(tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", _good_rows(5))
    source = FileSource(_plain(path, shuffle=False), CHARS)
    prompt = source.next()
    assert prompt.prompt_id == "train.jsonl:0"
    assert prompt.text == "what is 0 + 0?"
    assert prompt.prompt_ids == tuple(CHARS.encode("what is 0 + 0?", add_special_tokens=True))
    assert prompt.answer == "#### 0"
    assert prompt.metadata == {"source": path, "row": 0, "epoch": 0}
    assert source.num_rows == 5 and not source.skipped


def test_chat_template_and_system_prompt(tmp_path, hf_tokenizer):
    path = _write_jsonl(tmp_path / "train.jsonl", _good_rows(3))
    config = SourceConfig(path=path, id_field="id", system_prompt="be brief", shuffle=False)
    prompt = FileSource(config, hf_tokenizer).next()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 0 + 0?"}]
    assert prompt.text == hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert prompt.text.endswith("<|im_start|>assistant\n")
    assert prompt.prompt_ids == tuple(hf_tokenizer.encode(prompt.text))
    assert prompt.prompt_id == "q0"
    with pytest.raises(ValueError, match="chat_template=False"):
        FileSource(SourceConfig(path=path), CHARS)


def test_malformed_rows_are_skipped_and_counted(tmp_path):
    rows = _good_rows(10) + [
        {"answer": "1"},  # missing prompt
        {"question": "   ", "answer": "1"},  # empty prompt
        {"question": "what?", "answer": ""},  # empty answer
        {"question": "what?"},  # missing answer
        {"question": "x" * 100, "answer": "1"},  # too long
        {"question": "what is ~?", "answer": "1"},  # '~' is not in the alphabet
        {"question": 5, "answer": "1"},
    ]
    path = _write_jsonl(tmp_path / "mixed.jsonl", rows, extra_lines=["{not json", "[1, 2]", ""])
    config = _plain(path, max_prompt_tokens=50, max_bad_fraction=0.5, num_epochs=1)
    source = FileSource(config, CHARS)
    prompts = list(source)
    assert sorted(p.prompt_id for p in prompts) == sorted(f"mixed.jsonl:{i}" for i in range(10))
    assert source.skipped == collections.Counter(
        {
            "missing field 'question'": 1,
            "empty prompt": 1,
            "empty answer": 1,
            "missing field 'answer'": 1,
            "prompt too long": 1,
            "untokenizable prompt": 1,
            "prompt is not text or messages": 1,
            "invalid JSON": 1,
            "not a JSON object": 1,
        }
    )
    assert source.examined == 19


def test_too_many_bad_rows_is_an_error_naming_the_file(tmp_path):
    rows = [{"prompt": f"what is {i}?", "answer": "1"} for i in range(30)] + _good_rows(2)
    path = _write_jsonl(tmp_path / "wrong_field.jsonl", rows)
    source = FileSource(_plain(path, max_bad_fraction=0.1, min_rows_for_bad_check=20), CHARS)
    with pytest.raises(ValueError, match=r"wrong_field.jsonl: \d+ of 2\d rows skipped.*missing field 'question'"):
        for _ in range(30):
            source.next()


def test_a_file_without_a_usable_row_is_an_error(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"q": "1"}] * 3)
    with pytest.raises(ValueError, match="bad.jsonl"):
        FileSource(_plain(path, max_bad_fraction=1.0), CHARS).next()
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        FileSource(_plain(str(tmp_path / "nope.jsonl")), CHARS)


def test_order_is_a_seeded_permutation_per_epoch(tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", _good_rows(20))
    ids = lambda source, n: [source.next().prompt_id for _ in range(n)]  # noqa: E731
    first = ids(FileSource(_plain(path, seed=1), CHARS), 40)
    assert first == ids(FileSource(_plain(path, seed=1), CHARS), 40)
    assert first != ids(FileSource(_plain(path, seed=2), CHARS), 40)
    assert sorted(first[:20]) == sorted(first[20:]) == sorted(f"train.jsonl:{i}" for i in range(20))
    assert first[:20] != first[20:]  # reshuffled each epoch
    assert ids(FileSource(_plain(path, shuffle=False), CHARS), 3) == [f"train.jsonl:{i}" for i in range(3)]


def test_resume_continues_exactly(tmp_path):
    rows = _good_rows(9) + [{"question": "?"}]
    path = _write_jsonl(tmp_path / "train.jsonl", rows)
    config = _plain(path, seed=5, max_bad_fraction=0.5)
    source = FileSource(config, CHARS)
    for _ in range(13):
        source.next()
    state = json.loads(json.dumps(source.state()))
    expected = [source.next() for _ in range(15)]
    resumed = FileSource(config, CHARS)
    resumed.restore(state)
    assert [resumed.next() for _ in range(15)] == expected
    assert resumed.skipped == source.skipped and resumed.examined == source.examined
    with pytest.raises(ValueError, match="seed is 5 in the state but 6 here"):
        FileSource(_plain(path, seed=6), CHARS).restore(state)


def test_parquet_with_dotted_fields_and_message_prompts(tmp_path, hf_tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(
        [
            {
                "prompt": [{"role": "user", "content": f"what is {i} + 1 ?"}],
                "reward_model": {"ground_truth": str(i + 1)},
            }
            for i in range(6)
        ]
        + [{"prompt": [], "reward_model": {"ground_truth": "1"}}]
    )
    path = str(tmp_path / "dapo.parquet")
    pq.write_table(table, path)
    config = SourceConfig(
        path=path,
        prompt_field="prompt",
        answer_field="reward_model.ground_truth",
        shuffle=False,
        num_epochs=1,
        max_bad_fraction=0.5,
    )
    source = FileSource(config, hf_tokenizer)
    prompts = list(source)
    assert [p.answer for p in prompts] == [str(i + 1) for i in range(6)]
    assert prompts[2].text == "<|im_start|>user\nwhat is 2 + 1 ?<|im_end|>\n<|im_start|>assistant\n"
    assert source.skipped == {"empty prompt": 1}
    with pytest.raises(ValueError, match="dapo.parquet: no column 'question'.*'reward_model'"):
        FileSource(SourceConfig(path=path), hf_tokenizer)


def test_url_paths_read_through_the_fs_seam(tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", _good_rows(4))
    source = FileSource(_plain("file://" + path, shuffle=False), CHARS)
    assert source.next().text == "what is 0 + 0?"
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        FileSource(_plain("file://" + str(tmp_path / "missing.jsonl")), CHARS)


def test_hf_datasets_saved_to_disk(tmp_path):
    import datasets  # the test extra installs it

    rows = _good_rows(5)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows[:2])}).save_to_disk(str(tmp_path / "dd"))
    source = FileSource(_plain(str(tmp_path / "ds"), shuffle=False, id_field="id"), CHARS)
    assert [source.next().prompt_id for _ in range(6)] == ["q0", "q1", "q2", "q3", "q4", "q0"]
    split = FileSource(_plain(str(tmp_path / "dd"), split="test", format="hf_disk", num_epochs=1), CHARS)
    assert len(list(split)) == 2
    with pytest.raises(ValueError, match="no split 'train'.*'test'"):
        FileSource(_plain(str(tmp_path / "dd")), CHARS)


def test_missing_optional_packages_are_named(tmp_path, monkeypatch):
    (tmp_path / "ds").mkdir()
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)
    with pytest.raises(ImportError, match="pip install datasets"):
        FileSource(_plain(str(tmp_path / "ds")), CHARS)
