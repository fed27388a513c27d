"""Engine: log-probs vs a full forward, no recompiles after warm-up, bad calls, existing_prefix."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from dora_jax.core.records import Request, SamplingParams
from dora_jax.models import split
from dora_jax.rollout.worker import RolloutWorker, as_redispatch
from dora_jax.trainer.step import sequence_logps
from tests.rollout.conftest import TINY, run_to_end


def _request(i, prompt, max_new, sampling=SamplingParams(temperature=0.0), **kw):
    return Request(f"t{i}", "g", f"p{i}", tuple(prompt), 0, max_new, sampling, **kw)


def test_logprobs_equal_full_forward_log_softmax_at_the_temperature(warm_engine, tiny_model, tiny_params):
    """The engine's inference log-probs are log_softmax(logits / T) of a full forward (T = 1 for
    greedy rows, no top-k/top-p), and equal the trainer's log-probs at the same temperature
    (`sequence_logps`, the recompute and the loss's forward): the ratio compares one distribution."""
    worker = RolloutWorker(warm_engine, eos_ids=())
    worker.load_version(0, tiny_params)
    samplings = [
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=2),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_k=5, seed=3),
    ]
    for i, sampling in enumerate(samplings):
        worker.submit(_request(i, [1, 5 + i, 9, 14, 3 + 2 * i][: 3 + i % 3], 14, sampling))
    finished = run_to_end(worker)
    done = [finished[f"t{i}"] for i in range(len(samplings))]
    ids_BT = np.zeros((len(done), 24), np.int32)  # right-padded: causal, so padding changes nothing before it
    for b, traj in enumerate(done):
        ids_BT[b, : len(traj.prompt_ids) + len(traj.response_ids)] = traj.prompt_ids + traj.response_ids
    graphdef, _ = split(tiny_model)
    logits_BTV = np.asarray(jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(tiny_params, ids_BT), np.float64)
    trainer_logps = jax.jit(
        lambda p, x, t: sequence_logps(graphdef, p, x, vocab_chunk=0, temperature=t)[0], static_argnums=2
    )
    for b, (traj, sampling) in enumerate(zip(done, samplings, strict=True)):
        start, n = len(traj.prompt_ids), len(traj.response_ids)
        temperature = sampling.temperature or 1.0
        shifted_TV = logits_BTV[b] / temperature
        shifted_TV -= shifted_TV.max(-1, keepdims=True)
        logp_TV = shifted_TV - np.log(np.exp(shifted_TV).sum(-1, keepdims=True))  # float64 log_softmax(z / T)
        expected = logp_TV[np.arange(start - 1, start + n - 1), list(traj.response_ids)]
        np.testing.assert_allclose(traj.logprobs, expected, atol=2e-5, rtol=0)
        trainer = np.asarray(trainer_logps(tiny_params, ids_BT[b : b + 1], temperature))[0, start : start + n]
        np.testing.assert_allclose(traj.logprobs, trainer, atol=2e-5, rtol=0)
        assert n == 14 and traj.finish_reason.value == "length"


def test_no_recompiles_after_warmup(warm_engine, tiny_params):
    counts = warm_engine.compile_counts()
    assert counts["generate"] == 1
    assert counts["prefill"] >= len(warm_engine.config.prefill_buckets)
    worker = RolloutWorker(warm_engine, eos_ids=())
    worker.load_version(0, tiny_params)
    for i, length in enumerate([1, 2, 15, 16, 17, 31, 32, 7]):  # every prefill bucket, edges included
        prompt = [(3 * i + j) % TINY.vocab_size for j in range(length)]
        worker.submit(_request(i, prompt, 6 + i, SamplingParams(temperature=1.0, top_p=0.8, seed=i)))
    for i, length in enumerate([33, 48, 49], start=8):  # two chunks: 32 + 1, 32 + 16, 32 + 17
        worker.submit(_request(i, [(5 * i + j) % TINY.vocab_size for j in range(length)], 4, SamplingParams(seed=i)))
    for _ in range(3):
        worker.step()
    states = worker.export_requests()
    worker.import_requests(states[::-1])  # every exported slot comes back, in other slots
    worker.submit(
        as_redispatch(dataclasses.replace(states[0], request=dataclasses.replace(states[0].request, traj_id="r")))
    )
    run_to_end(worker)
    assert warm_engine.compile_counts() == counts


def test_bad_engine_calls_raise_value_errors(warm_engine, tiny_params):
    params = warm_engine.load_params(tiny_params)
    with pytest.raises(ValueError, match="max_prefill_length=32"):
        warm_engine.prefill(params=params, padded_tokens=np.ones(40, np.int32), true_length=33)
    with pytest.raises(ValueError, match="token id 96 outside the vocabulary"):
        warm_engine.prefill(params=params, padded_tokens=np.array([1, 96]), true_length=2)
    with pytest.raises(ValueError, match="true_length=0"):
        warm_engine.prefill(params=params, padded_tokens=np.array([1, 2]), true_length=0)
    with pytest.raises(ValueError, match="sampling.top_p=0.0"):
        warm_engine.prefill(
            params=params, padded_tokens=np.array([1]), true_length=1, sampling=SamplingParams(top_p=0.0)
        )
    state = warm_engine.init_decode_state()
    with pytest.raises(ValueError, match="slot=4"):
        warm_engine.insert(None, state, 4)
    bad = jax.tree.map(lambda x: x[..., :1], tiny_params)
    with pytest.raises(ValueError, match="has shape"):
        warm_engine.load_params(bad)


def test_existing_prefix_continues_the_text(warm_engine, tiny_params):
    params = warm_engine.load_params(tiny_params)
    tokens = np.array([1, 7, 22, 40, 3, 11, 5, 60, 9], np.int32)
    whole, first = warm_engine.prefill(params=params, padded_tokens=tokens, true_length=len(tokens))
    head, _ = warm_engine.prefill(params=params, padded_tokens=tokens[:4], true_length=4)
    joined, joined_first = warm_engine.prefill(
        params=params, existing_prefix=head, padded_tokens=tokens[4:], true_length=len(tokens) - 4
    )
    assert int(joined.length) == int(whole.length) == len(tokens)
    assert int(joined_first.data[0, 0]) == int(first.data[0, 0])
    np.testing.assert_allclose(joined_first.log_prob, first.log_prob, atol=1e-5)
    rows = len(tokens)
    np.testing.assert_allclose(np.asarray(joined.k_LRKD)[:, :rows], np.asarray(whole.k_LRKD)[:, :rows], atol=1e-5)


def test_chunked_prefill_past_the_largest_bucket(warm_engine, tiny_params):
    """49 tokens (> max_prefill_length=32) as 32 + 17 and as 32 + 1 + 16: the same KV rows and first
    token. The second chain's prefix has 64 rows (a padded bucket) but only 33 tokens: rows past the
    prefix's length are padding, so 33 + 16 fits the 64-row cache."""
    params = warm_engine.load_params(tiny_params)
    tokens = np.arange(1, 50, dtype=np.int32) % 90 + 3
    assert warm_engine.config.prefill_chunks(49) == (32, 17)

    def chain(sizes):
        prefix, first, begin = None, None, 0
        for size in sizes:
            prefix, first = warm_engine.prefill(
                params=params, existing_prefix=prefix, padded_tokens=tokens[begin : begin + size], true_length=size
            )
            begin += size
        return prefix, first

    two, first_two = chain((32, 17))
    three, first_three = chain((32, 1, 16))
    assert int(two.length) == int(three.length) == 49 and three.k_LRKD.shape[1] == 64
    assert int(first_two.data[0, 0]) == int(first_three.data[0, 0])
    np.testing.assert_allclose(first_two.log_prob, first_three.log_prob, atol=1e-5)
    np.testing.assert_allclose(np.asarray(two.k_LRKD)[:, :49], np.asarray(three.k_LRKD)[:, :49], atol=1e-5)
    with pytest.raises(ValueError, match="exceed cache_length=64"):
        warm_engine.prefill(params=params, existing_prefix=three, padded_tokens=tokens[:16], true_length=16)
