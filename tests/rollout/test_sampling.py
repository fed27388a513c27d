"""Sampling: filters, greedy rule, log-probs, that draws follow the intended distribution, and
that vocab-sharded sampling equals the unsharded rule without gathering the logits."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from dora_jax.models import ModelConfig
from dora_jax.parallel import sharding
from dora_jax.rollout import sampling
from dora_jax.rollout.engine import EngineConfig, RolloutEngine

LOGITS = np.log(np.array([0.5, 0.25, 0.15, 0.1], np.float32))


def test_filters_keep_the_top_k_and_the_nucleus():
    logits_BV = jnp.asarray(np.stack([LOGITS] * 4))
    top_k_B = jnp.array([2, 0, 0, 1])
    top_p_B = jnp.array([1.0, 0.7, 0.8, 1.0])
    kept = np.isfinite(np.asarray(jax.jit(sampling.filter_logits)(logits_BV, top_k_B, top_p_B)))
    assert kept.tolist() == [
        [True, True, False, False],  # top-2
        [True, True, False, False],  # 0.5 + 0.25 >= 0.7
        [True, True, True, False],  # needs 0.9 >= 0.8
        [True, False, False, False],
    ]


_SAMPLE = jax.jit(sampling.sample)
N = 8000


def _draw(temperature=1.0, top_p=1.0, top_k=0):
    """N draws from one slot's stream, at positions 0..N-1 (one compiled program for every call)."""
    key_B2 = jnp.asarray(np.tile(sampling.base_key_data(7), (N, 1)))
    return _SAMPLE(
        jnp.asarray(np.tile(LOGITS, (N, 1))),
        key_B2,
        jnp.arange(N, dtype=jnp.int32),
        jnp.full((N,), temperature, jnp.float32),
        jnp.full((N,), top_p, jnp.float32),
        jnp.full((N,), top_k, jnp.int32),
    )


def _log_softmax(x):
    return x - np.log(np.exp(x - x.max()).sum()) - x.max()


def test_draws_follow_the_distribution_and_log_probs_are_at_the_temperature_unfiltered():
    tokens, logp, sample_logp = map(np.asarray, _draw())
    freq = np.bincount(tokens, minlength=4) / len(tokens)
    np.testing.assert_allclose(freq, np.exp(LOGITS), atol=0.02)
    np.testing.assert_allclose(logp, LOGITS[tokens], atol=1e-6)
    np.testing.assert_allclose(sample_logp, LOGITS[tokens], atol=1e-6)

    tokens, logp, sample_logp = map(np.asarray, _draw(temperature=0.5, top_k=3))
    sharpened = np.exp(2 * LOGITS[:3]) / np.exp(2 * LOGITS[:3]).sum()
    np.testing.assert_allclose(np.bincount(tokens, minlength=4)[:3] / len(tokens), sharpened, atol=0.02)
    assert (tokens < 3).all()
    # logp: the temperature's distribution over the whole vocabulary (what the trainer recomputes),
    # sample_logp: the filtered one actually sampled from.
    np.testing.assert_allclose(logp, _log_softmax(LOGITS / 0.5)[tokens], atol=1e-6)
    np.testing.assert_allclose(sample_logp, np.log(sharpened)[tokens], atol=1e-5)


def test_greedy_is_argmax_and_streams_are_counter_based():
    tokens, logp, sample_logp = map(np.asarray, _draw(temperature=0.0))
    assert (tokens == 0).all() and (sample_logp == 0).all()
    np.testing.assert_allclose(logp, LOGITS[0], atol=1e-6)
    first, again = np.asarray(_draw()[0]), np.asarray(_draw()[0])
    assert (first == again).all() and len(set(first.tolist())) > 1  # same key + position: same draw


# ---------------------------------------------------------------- vocab-parallel sampling

B, V = 8, 512
TEMPERATURE_B = np.array([0.0, 1.0, 0.7, 0.0, 1.3, 1.0, 0.5, 2.0], np.float32)  # rows 0 and 3 greedy


def _sharded_logits(shards: int) -> np.ndarray:
    """Random rows, with the mass or the max pushed into the first or the last shard."""
    logits_BV = 3 * np.random.default_rng(shards).normal(size=(B, V)).astype(np.float32)
    shard = V // shards
    logits_BV[0, 5] = logits_BV[0, V - 3] = 40.0  # greedy tie across shards: the lower index wins
    logits_BV[3, V - 7] = 40.0  # greedy, max in the last shard
    logits_BV[1, shard:] -= 30.0  # sampled, all the mass in the first shard
    logits_BV[5, : V - shard] -= 30.0  # sampled, all the mass in the last shard
    return logits_BV


def _rows(filtered: bool):
    key_data_B2 = np.stack([sampling.base_key_data(seed) for seed in range(B)])
    position_B = np.arange(B, dtype=np.int32) + 11
    top_p_B = np.array([1, 1, 0.9, 1, 1, 1, 0.6, 1] if filtered else [1] * B, np.float32)
    top_k_B = np.array([0, 0, 0, 5, 0, 0, 0, 20] if filtered else [0] * B, np.int32)
    return key_data_B2, position_B, TEMPERATURE_B, top_p_B, top_k_B


def _sample_on(mesh, filters: bool):
    """`sample` jitted with `mesh` and the rollout rules in context (as the engine traces it)."""

    def run(*args):
        with sharding.activation_layout(mesh, sharding.ROLLOUT_RULES):
            return sampling.sample(*args, filters=filters)

    return jax.jit(run)


@pytest.mark.parametrize("shards", [2, 4])
@pytest.mark.parametrize("filters", [False, True])
def test_vocab_sharded_sampling_equals_the_unsharded_rule(shards, filters):
    logits_BV = _sharded_logits(shards)
    rows = _rows(filtered=filters)
    expected = [
        np.asarray(x) for x in jax.jit(sampling.sample, static_argnames="filters")(logits_BV, *rows, filters=filters)
    ]
    mesh = sharding.make_mesh(jax.devices()[:shards], {"tensor": shards})
    placed_BV = jax.device_put(logits_BV, NamedSharding(mesh, PartitionSpec(None, "tensor")))
    tokens_B, logp_B, sample_logp_B = (np.asarray(x) for x in _sample_on(mesh, filters)(placed_BV, *rows))
    np.testing.assert_array_equal(tokens_B, expected[0])
    np.testing.assert_allclose(logp_B, expected[1], atol=1e-5, rtol=0)
    np.testing.assert_allclose(sample_logp_B, expected[2], atol=1e-5, rtol=0)
    shard_B = tokens_B // (V // shards)
    assert tokens_B[0] == 5 and shard_B[3] == shards - 1  # greedy: first index on a tie, last shard
    assert shard_B[1] == 0 and shard_B[5] == shards - 1  # sampled: first shard, last shard
    assert (sample_logp_B[[0, 3]] == 0).all()  # greedy rows


_COLLECTIVE = re.compile(r"=\s*(.*?)\s+(all-gather|all-reduce|all-to-all|collective-permute)(?:-start)?\(")


def _collective_shapes(hlo_text: str) -> dict[str, set[tuple[int, ...]]]:
    """{collective: result shapes} over compiled HLO text (sync ops and async starts)."""
    shapes = {}
    for line in hlo_text.splitlines():
        match = _COLLECTIVE.search(line)
        if match:
            dims = re.findall(r"[a-z0-9]+\[([0-9,]*)\]", match.group(1))
            shapes.setdefault(match.group(2), set()).update(tuple(int(d) for d in x.split(",") if d) for x in dims)
    return shapes


def test_a_tensor_parallel_decode_step_gathers_no_vocab_row():
    """Compiled for tensor=4 (fake devices), a decode step with a large vocabulary moves no [B, V]
    array between devices (no all-gather, nor any other collective, of that shape); the unsharded
    rule on the same sharded logits all-gathers one (so the check can fail)."""
    mesh = sharding.make_mesh(jax.devices()[:4], {"tensor": 4})
    slots, vocab = 8, 4096
    model = ModelConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_layers=1,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
    )
    config = EngineConfig(
        num_slots=slots, cache_length=32, max_prefill_length=16, min_prefill_bucket=16, sampling_filters=False
    )
    engine = RolloutEngine(model, config, mesh)
    generate = _collective_shapes(dict(engine.lower_programs())["generate"].compile().as_text())
    assert generate["all-gather"] and not any((slots, vocab) in shapes for shapes in generate.values())

    placed_BV = jax.ShapeDtypeStruct(
        (slots, vocab), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec(None, "tensor"))
    )
    rows = _rows(filtered=False)  # B == slots
    old = jax.jit(sampling.sample, static_argnames="filters").lower(placed_BV, *rows, filters=False)
    assert (slots, vocab) in _collective_shapes(old.compile().as_text())["all-gather"]
    new = _collective_shapes(_sample_on(mesh, filters=False).lower(placed_BV, *rows).compile().as_text())
    assert not any((slots, vocab) in shapes for shapes in new.values())
