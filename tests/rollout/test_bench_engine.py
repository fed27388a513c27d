"""`bench engine` on a very small configuration: the schema of engine.json and no recompiles."""

from __future__ import annotations

import dataclasses
import json

from dora_jax.bench_engine import EngineBenchConfig, format_table, run_engine_bench


def test_engine_bench_writes_the_documented_json(tmp_path):
    config = EngineBenchConfig(slots=2, cache_length=32, max_prefill_length=16, prompt_length=4, decode_steps=3,
                               prefill_repeats=2, vocab_size=64)
    results = run_engine_bench(config, str(tmp_path))
    on_disk = json.loads((tmp_path / "engine.json").read_text())
    assert on_disk["slots"] == 2 and on_disk["compiles_after_warmup"] == 0
    assert [p["active_slots"] for p in on_disk["decode"]] == [1, 2]
    for point in on_disk["decode"]:
        assert {"active_slots", "step_time_s", "tokens_per_s", "batch_step_time_s"} <= point.keys()
        assert point["tokens_per_s"] > 0
    assert [p["bucket"] for p in on_disk["prefill"]] == [16]
    assert on_disk["model"]["hidden_size"] == 64 and on_disk["flat_ratio"] > 0
    assert "compiles after warm-up: 0" in format_table(results)


def test_engine_bench_of_a_moe_config_measures_the_moe_model(tmp_path):
    import importlib.util
    import os

    from dora_jax.bench_modes import engine_bench_config

    path = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "smoke_moe.py")
    spec = importlib.util.spec_from_file_location("smoke_moe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config()
    config = engine_bench_config(cfg)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 128)
    config = dataclasses.replace(config, slots=2, cache_length=32, max_prefill_length=16, prompt_length=4,
                                 decode_steps=2, prefill_repeats=1, batch_curve=False, tensor_parallel=1)
    results = run_engine_bench(config, str(tmp_path))
    dense = dataclasses.replace(config, num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0)
    assert results["model"]["num_experts"] == 8 and results["compiles_after_warmup"] == 0
    # the measured model has the experts: per layer, 8 SwiGLU experts and a router instead of the dense
    # MLP, and Qwen3's q/k norms
    H, I, M, E, D = config.hidden_size, config.intermediate_size, 128, 8, config.head_dim
    per_layer = E * 3 * H * M + H * E - 3 * H * I + 2 * D
    dense_params = run_engine_bench(dense, None)["model"]["params"]
    assert results["model"]["params"] == dense_params + config.num_layers * per_layer
