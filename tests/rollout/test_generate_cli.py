"""`python -m dora_jax.generate`: its main() on the tiny Llama checkpoint with a tokenizer.json."""

from __future__ import annotations

import json

import pytest
import torch

from dora_jax.cli import generate
from tests.models.hf_fixtures import make_checkpoint


@pytest.mark.slow
def test_cli_prints_one_json_line_last(llama_checkpoint, capsys):
    path, torch_model = llama_checkpoint
    generate.main(
        [
            f"--hf_path={path}",
            "--prompt=w1 w17 w33 w54 w5",
            "--max_new_tokens=12",
            "--temperature=0",
            "--tensor_parallel=2",
        ]
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    with torch.no_grad():
        ref = torch_model.generate(
            torch.tensor([[1, 17, 33, 54, 5]]), do_sample=False, max_new_tokens=12, pad_token_id=0
        )[0, 5:].tolist()
    assert result["token_ids"] == ref  # the HF greedy test covers near-tie caveats; none here
    assert len(result["logprobs"]) == len(ref) and all(lp <= 0 for lp in result["logprobs"])
    assert result["text"] == " ".join(f"w{i}" for i in ref)
    assert result["finish_reason"] in ("eos", "length")
    generate.main([f"--hf_path={path}", "--prompt_ids=1,17,33,54,5", "--max_new_tokens=12", "--tensor_parallel=2"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"] == ref


def test_bad_arguments_are_named(tmp_path):
    make_checkpoint("qwen2", tmp_path)
    with pytest.raises(ValueError, match="tokenizer.json"):
        generate.main([f"--hf_path={tmp_path}", "--prompt=hello"])
    with pytest.raises(ValueError, match="exactly one of"):
        generate.main([f"--hf_path={tmp_path}"])
