"""The supervised cold start: it trains on the RL run's task distribution (other prompts), on the
trainer mesh, and lowers the demonstrations' loss; the run caches it as a HF checkpoint."""

import json
import os

import numpy as np
import pytest

from dora_jax import models
from dora_jax.models.tokenizer import CharTokenizer
from dora_jax.runtime import run_config
from dora_jax.runtime.build import fresh_model_config, make_tokenizer
from dora_jax.runtime.cold_start import cold_start
from dora_jax.tasks import running_sums
from tests.helpers import tiny_config


def _config(max_term: int, sft_steps: int):
    c = tiny_config("dora")
    with c.unlocked():
        c.task.max_term = max_term
        c.init.sft_steps = sft_steps
        c.init.sft_batch_size = 16
        c.mesh.trainer = {"fsdp": 2}
    return run_config.parse(c)


def test_demonstrations_follow_the_configured_task():
    from dora_jax.runtime.cold_start import demonstration_batch, demonstration_source

    config = _config(max_term=7, sft_steps=1)
    tokenizer = CharTokenizer(running_sums.ALPHABET)
    source = demonstration_source(config, tokenizer)
    prompts = [source.next() for _ in range(200)]
    terms = [t for p in prompts for t in running_sums.parse_terms(p.text)]
    assert max(terms) == 7 and min(terms) == 0
    assert max(p.metadata["k"] for p in prompts) <= config.task.k_max
    rl_source = running_sums.RunningSumsSource(
        running_sums.RunningSumsConfig(
            median_k=config.task.median_k,
            sigma=config.task.sigma,
            k_max=config.task.k_max,
            max_term=7,
            seed=config.seed,
        ),
        tokenizer,
    )
    assert source.prompt(0).text != rl_source.prompt(0).text  # other prompts than the RL run's

    tokens, mask = demonstration_batch(demonstration_source(config, tokenizer), tokenizer, 4, pad_to=16)
    assert tokens.shape[1] % 16 == 1 and mask.shape == tokens.shape
    first = demonstration_source(config, tokenizer).next()
    want = tokenizer.encode(running_sums.demonstration(first)) + [tokenizer.eos_ids[0]]
    row = tokens[0][mask[0] > 0].tolist()
    assert row == want


@pytest.mark.slow
def test_cold_start_lowers_the_loss_and_is_cached(tmp_path):
    config = _config(max_term=2, sft_steps=60)
    tokenizer = make_tokenizer(config)
    model_config = fresh_model_config(config, tokenizer.vocab_size, tokenizer.eos_ids)
    model = cold_start(config, model_config, tokenizer, str(tmp_path))
    log = [json.loads(line) for line in open(tmp_path / "sft_log.jsonl")]
    assert [r["sft_step"] for r in log] == [0, 25, 50, 59]
    assert log[-1]["loss"] < 0.6 * log[0]["loss"], log
    assert os.path.exists(tmp_path / "sft" / "DONE")

    again = cold_start(config, model_config, tokenizer, str(tmp_path))  # cached: loaded, not retrained
    assert len(open(tmp_path / "sft_log.jsonl").readlines()) == len(log)
    _, a = models.split(model)
    _, b = models.split(again)
    for x, y in zip(_leaves(a), _leaves(b)):
        np.testing.assert_array_equal(x, y)


def _leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


@pytest.mark.slow
def test_the_cold_start_is_cached_on_a_gs_workdir(gcs_root):
    """HF safetensors I/O is local: the checkpoint is copied to and from gs:// through dora_jax.core.fs."""
    from dora_jax.core import fs

    config = _config(max_term=2, sft_steps=2)
    tokenizer = make_tokenizer(config)
    model_config = fresh_model_config(config, tokenizer.vocab_size, tokenizer.eos_ids)
    model = cold_start(config, model_config, tokenizer, gcs_root)
    assert fs.exists(fs.join(gcs_root, "sft", "DONE")) and "model.safetensors" in fs.listdir(fs.join(gcs_root, "sft"))
    with fs.open(fs.join(gcs_root, "sft_log.jsonl")) as f:
        assert [json.loads(line)["sft_step"] for line in f] == [0, 1]
    again = cold_start(config, model_config, tokenizer, gcs_root)  # cached: loaded from the bucket
    _, a = models.split(model)
    _, b = models.split(again)
    for x, y in zip(_leaves(a), _leaves(b)):
        np.testing.assert_array_equal(x, y)
