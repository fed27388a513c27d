"""Shared tiny models and engines for the rollout tests (session scope: compiles are the cost)."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from dora_jax.models import ModelConfig, init_model, split
from dora_jax.parallel import sharding
from dora_jax.rollout.engine import EngineConfig, RolloutEngine

TINY = ModelConfig(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    eos_token_id=2,
)
ENGINE = EngineConfig(num_slots=4, cache_length=64, max_prefill_length=32, min_prefill_bucket=16)
PAGED = dataclasses.replace(ENGINE, page_size=8)  # a pool for every slot at cache_length: 4 x 8 pages + scratch


@pytest.fixture(scope="session")
def tiny_model():
    return init_model(TINY, seed=3)


@pytest.fixture(scope="session")
def tiny_params(tiny_model):
    return split(tiny_model)[1]


@pytest.fixture(scope="session")
def slices():
    """Two rollout slices of 2 devices each (tensor parallel), disjoint from a 1-device trainer."""
    return sharding.split_devices({"data": 1}, {"tensor": 2}, 2, devices=jax.devices()[:5])


@pytest.fixture(scope="session")
def engine(slices):
    """The engine most tests share: 4 slots on rollout slice 0."""
    return RolloutEngine(TINY, ENGINE, slices.rollout[0])


@pytest.fixture(scope="session")
def engine_b(slices):
    """The same engine shape on rollout slice 1 (other devices): the migration destination."""
    return RolloutEngine(TINY, ENGINE, slices.rollout[1])


def warm(engine: RolloutEngine, params) -> RolloutEngine:
    """`engine` with every program compiled (prefill buckets, row buckets, generate): warmed on
    first use and again after tests/conftest.py drops jax's compiled programs at a module's end
    (the engines live for the session; their programs do not)."""
    if not engine.compile_counts()["generate"]:
        engine.warmup(engine.load_params(params))
    return engine


@pytest.fixture(scope="session")
def _paged_engine(slices):
    return RolloutEngine(TINY, PAGED, slices.rollout[0])


@pytest.fixture(scope="session")
def _paged_engine_b(slices):
    return RolloutEngine(TINY, PAGED, slices.rollout[1])


@pytest.fixture
def paged_engine(_paged_engine, tiny_params):
    """The paged KV cache on rollout slice 0, warm."""
    return warm(_paged_engine, tiny_params)


@pytest.fixture
def paged_engine_b(_paged_engine_b, tiny_params):
    """The paged KV cache on rollout slice 1 (the migration destination), warm."""
    return warm(_paged_engine_b, tiny_params)


@pytest.fixture
def warm_engine(engine, tiny_params):
    """`engine`, warm."""
    return warm(engine, tiny_params)


def run_to_end(worker, max_steps: int = 500) -> dict:
    """Steps `worker` until it has no work; {traj_id: Trajectory}."""
    done = {}
    for _ in range(max_steps):
        if not worker.has_work:
            return done
        done.update({t.traj_id: t for t in worker.step()})
    raise AssertionError(f"worker still busy after {max_steps} steps")


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory):
    """(path, torch model) of the tiny random Llama checkpoint, with a word-level tokenizer.json
    over its whole vocabulary (id i is the word `w{i}`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tests.models.hf_fixtures import VOCAB, make_checkpoint

    path = tmp_path_factory.mktemp("llama")
    torch_model = make_checkpoint("llama", path)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return str(path), torch_model
