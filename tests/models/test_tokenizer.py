"""Tokenizers: ours against transformers' own fast tokenizer on a tokenizer made in the test."""

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from dora_jax.models.tokenizer import CharTokenizer, HFTokenizer

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture()
def tokenizer_dir(tmp_path):
    words = ["hello", "world", "what", "is", "2", "+", "?", "user", "assistant", "\n"]
    vocab = {w: i for i, w in enumerate(["<unk>", "<|im_start|>", "<|im_end|>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": TEMPLATE,
                "eos_token": "<|im_end|>",
                "pad_token": "<unk>",
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    return tmp_path


def test_hf_tokenizer_matches_transformers(tokenizer_dir):
    import transformers

    ours = HFTokenizer(str(tokenizer_dir))
    ref = transformers.PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
    messages = [{"role": "user", "content": "what is 2 + 2 ?"}]
    rendered = ours.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered == ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.encode("hello world") == ref.encode("hello world", add_special_tokens=False) == [3, 4]
    assert ours.decode([3, 4]) == "hello world"
    assert ours.eos_ids == (2,) and ours.pad_id == 0


def test_missing_tokenizer_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json: not found"):
        HFTokenizer(str(tmp_path))


def test_char_tokenizer_round_trip_and_errors():
    tok = CharTokenizer("0123456789+=,;")
    ids = tok.encode("12+3=15", add_special_tokens=True)
    assert ids[0] == CharTokenizer.BOS and tok.decode(ids) == "12+3=15"
    assert tok.vocab_size == 17
    with pytest.raises(ValueError, match=r"character 'x' is not in the alphabet"):
        tok.encode("x")
    with pytest.raises(ValueError, match=r"token id 99 is outside the vocabulary"):
        tok.decode([99])
