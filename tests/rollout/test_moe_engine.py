"""Greedy generation of a Qwen3-MoE checkpoint through the engine, experts sharded over the
`expert` axis of the rollout mesh, equals HF transformers' greedy generation (with "megablox": expert
parallelism through the kernels, in the Pallas interpreter)."""

from __future__ import annotations

import jax
import pytest

from dora_jax.core.records import Request, SamplingParams
from dora_jax.models import read_config
from dora_jax.parallel import sharding
from dora_jax.rollout.engine import RolloutEngine
from dora_jax.rollout.worker import RolloutWorker
from tests.models.hf_fixtures import VOCAB
from tests.models.test_moe import make_moe_checkpoint
from tests.rollout.test_engine_hf import ENGINE, MAX_NEW, PROMPTS, _assert_same_greedy, _hf_greedy


@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["dense", "grouped", "megablox_interpret"])
def test_moe_greedy_matches_transformers(dispatch, tmp_path):
    path, torch_model = str(tmp_path), make_moe_checkpoint(tmp_path)
    mesh = sharding.make_mesh(jax.devices()[:8], {"expert": 4, "tensor": 2})
    engine = RolloutEngine(read_config(path).replace(moe_dispatch=dispatch), ENGINE, mesh)
    params = engine.load_params(hf_path=path)
    gate = params["layers"][0]["mlp"]["gate_XEM"]
    assert gate.sharding.spec[0] == "expert" and gate.addressable_shards[0].data.shape[0] == 2
    worker = RolloutWorker(engine)
    worker.load_version(0, params)
    for i, prompt in enumerate(PROMPTS):
        worker.submit(Request(f"t{i}", "g", f"p{i}", tuple(prompt), 0, MAX_NEW, SamplingParams(temperature=0.0)))
    done = {}
    while worker.has_work:
        done.update({t.traj_id: t for t in worker.step()})
    for i, prompt in enumerate(PROMPTS):
        ref, scores = _hf_greedy(torch_model, prompt)
        assert max(done[f"t{i}"].response_ids) < VOCAB
        _assert_same_greedy(list(done[f"t{i}"].response_ids), ref, scores)
