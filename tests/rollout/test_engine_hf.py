"""Greedy generation through the engine equals HF transformers' greedy generation."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import torch

from dora_jax.core.records import Request, SamplingParams
from dora_jax.models import read_config
from dora_jax.parallel import sharding
from dora_jax.rollout.engine import EngineConfig, RolloutEngine
from dora_jax.rollout.worker import RolloutWorker
from tests.models.hf_fixtures import VOCAB, make_checkpoint

MAX_NEW = 12
PROMPTS = ([1, 17, 33, 54, 5], [1, 99, 4, 7, 81, 23, 64, 12, 90])


def _hf_greedy(torch_model, prompt):
    with torch.no_grad():
        out = torch_model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=MAX_NEW,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    scores = [s[0].numpy() for s in out.scores]
    return tokens, scores


def _assert_same_greedy(ours, ref, scores):
    """Token-for-token equality, except that after a step where HF's own top-2 logits tie within
    1e-5 (either token is a correct argmax) the sequences may legitimately diverge."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = np.sort(scores[i])[-2:]
            assert top2[1] - top2[0] < 1e-5, f"step {i}: ours {a}, HF {b}, HF top-2 gap {top2[1] - top2[0]}"
            return
    assert len(ours) == len(ref)


# The same sizes and mesh as `python -m dora_jax.generate --tensor_parallel=2` picks for these
# prompts, so that its test reuses these compiled programs.
ENGINE = EngineConfig(num_slots=1, cache_length=32, max_prefill_length=16)


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [0, 8])  # the dense cache, and pages of 8 rows
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers(kind, page_size, tmp_path, llama_checkpoint):
    if kind == "llama":
        path, torch_model = llama_checkpoint
    else:
        path, torch_model = str(tmp_path), make_checkpoint(kind, tmp_path)
    mesh = sharding.make_mesh(jax.devices()[:2], {"tensor": 2})
    engine = RolloutEngine(read_config(path), dataclasses.replace(ENGINE, page_size=page_size), mesh)
    worker = RolloutWorker(engine)
    worker.load_version(0, engine.load_params(hf_path=path))
    for i, prompt in enumerate(PROMPTS):
        worker.submit(Request(f"t{i}", "g", f"p{i}", tuple(prompt), 0, MAX_NEW, SamplingParams(temperature=0.0)))
    done = {}
    while worker.has_work:
        done.update({t.traj_id: t for t in worker.step()})
    for i, prompt in enumerate(PROMPTS):
        ref, scores = _hf_greedy(torch_model, prompt)
        assert done[f"t{i}"].finish_reason.value in ("eos", "length")
        assert max(done[f"t{i}"].response_ids) < VOCAB
        _assert_same_greedy(list(done[f"t{i}"].response_ids), ref, scores)
