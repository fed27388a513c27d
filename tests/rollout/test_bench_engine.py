"""`bench engine` on a very small configuration: the schema of engine.json and no recompiles."""

from __future__ import annotations

import dataclasses
import json

import jax
import pytest
from flax import nnx

from dora_jax.bench.engine import EngineBenchConfig, _model_config, format_table, run_engine_bench
from dora_jax.bench.modes import engine_bench_config
from dora_jax.models import init_model
from tests.launch.configs import load

SMALL = EngineBenchConfig(
    slots=2, cache_length=32, max_prefill_length=16, prompt_length=4, decode_steps=3, prefill_repeats=2, vocab_size=64
)


@pytest.mark.slow
def test_engine_bench_writes_the_documented_json(tmp_path):
    config = SMALL
    results = run_engine_bench(config, str(tmp_path))
    on_disk = json.loads((tmp_path / "engine.json").read_text())
    assert on_disk["slots"] == 2 and on_disk["compiles_after_warmup"] == 0
    assert [p["active_slots"] for p in on_disk["decode"]] == [1, 2]
    for point in on_disk["decode"]:
        assert {"active_slots", "step_time_s", "tokens_per_s", "batch_step_time_s"} <= point.keys()
        assert point["tokens_per_s"] > 0
    assert [p["bucket"] for p in on_disk["prefill"]] == [16]
    assert on_disk["model"]["hidden_size"] == 64 and on_disk["flat_ratio"] > 0
    loop = on_disk["worker_loop"]
    for name in ("bare", "worker", "unpipelined_worker"):
        assert loop[f"{name}_step_time_s"] > 0
    assert loop["worker_overhead"] > 0 and loop["unpipelined_worker_overhead"] > 0 and loop["blocks"] == 2
    assert on_disk["decode"][-1]["worker_step_time_s"] == loop["worker_step_time_s"]
    # the dense cache: 2 layers x (k, v) x 2 kv heads x 16 dims x 4 bytes (fp32) per token row, 32 rows a slot
    assert on_disk["kv"]["bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert on_disk["kv"]["cache_bytes"] == 2 * 32 * on_disk["kv"]["bytes_per_token"]
    assert (on_disk["kv"]["capacity_slots"], on_disk["kv"]["capacity_tokens"]) == (2, 64)
    assert 2 * 4 < on_disk["kv"]["live_tokens"] <= 64  # two prompts of 4 and their responses so far
    assert "compiles after warm-up: 0" in format_table(results)
    # One request moved between two slices: prompts of 4, 16 and 23 tokens (the longest that fits
    # with its 8-token budget) and the 2 tokens it holds after one step.
    moves = on_disk["migration"]
    assert [m["prefix_tokens"] for m in moves] == [5, 17, 24]
    for m in moves:
        assert m["kv_bytes"] == m["prefix_tokens"] * on_disk["kv"]["bytes_per_token"]
        assert m["kv_bytes_moved"] >= m["kv_bytes"] and m["measured_link_bytes_per_s"] > 0
        assert min(m["kv_transfer_s"], m["kv_pull_s"], m["kv_host_s"], m["reprefill_s"]) > 0
        assert m["kv_pull_s"] < m["kv_transfer_s"]
        assert m["rule"] in ("kv", "reprefill") and m["cheaper_measured"] in ("kv", "reprefill")
    assert "re-prefill ms" in format_table(results)
    work = on_disk["workload"]  # 2 prompts of 4 tokens (the slots), 64 tokens each, both ways
    assert (work["sequences"], work["prompt_length"], work["new_tokens"], work["same_tokens"]) == (2, 4, 64, True)
    for path in ("one_at_a_time", "batched"):
        assert 0 < work[path]["prefill_share"] < 1 and len(work[path]["rounds_s"]) == 3
        assert work[path]["tokens_per_s"] == pytest.approx(2 * 64 / work[path]["seconds"])
    assert work["speedup"] > 0 and "batched / one-at-a-time tokens/s" in format_table(results)


def test_engine_bench_workload_alone_runs_both_paths_to_the_same_tokens(tmp_path):
    config = dataclasses.replace(SMALL, workload_only=True, workload_new_tokens=5, workload_rounds=1)
    results = run_engine_bench(config, str(tmp_path))
    on_disk = json.loads((tmp_path / "engine.json").read_text())
    assert set(on_disk) == {"workload", "compiles_after_warmup", "model", "slots", "devices"}
    assert on_disk["compiles_after_warmup"] == 0 and on_disk["workload"]["same_tokens"]
    assert on_disk["workload"]["batched"]["decode_step_s"] > 0
    assert "one_at_a_time" in format_table(results)


def test_engine_bench_of_a_moe_config_builds_the_moe_model():
    """The engine under test is `_model_config(config)`: for configs/smoke_moe.py, the Qwen3-MoE."""
    config = engine_bench_config(load("smoke_moe.py"))
    moe = _model_config(config)
    assert (moe.model_type, moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (
        "qwen3_moe",
        8,
        2,
        128,
    )
    assert moe.norm_topk_prob and moe.moe_dispatch == "dense"
    dense = _model_config(dataclasses.replace(config, num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0))
    count = lambda c: sum(x.size for x in jax.tree.leaves(nnx.state(init_model(c, seed=0), nnx.Param)))  # noqa: E731
    # per layer: 8 SwiGLU experts of width 128 and a router instead of the dense MLP, and Qwen3's q/k norms
    H, F, M, E, D = config.hidden_size, config.intermediate_size, 128, 8, config.head_dim
    assert count(moe) == count(dense) + config.num_layers * (E * 3 * H * M + H * E - 3 * H * F + 2 * D)


@pytest.mark.slow
def test_engine_bench_of_a_paged_engine_times_it_beside_the_dense_one(tmp_path):
    config = dataclasses.replace(SMALL, page_size=8)
    results = run_engine_bench(config, str(tmp_path))
    assert results["compiles_after_warmup"] == 0
    loop, kv = results["worker_loop"], results["kv"]
    assert loop["dense_worker_step_time_s"] > 0 and loop["paged_speedup_over_dense"] > 0
    # pages of 8 rows: 2 layers x (k, v) x 2 kv heads x 16 dims x 4 bytes per row; a pool of every slot full
    assert kv["bytes_per_token"] == 2 * 2 * 2 * 16 * 4 and kv["bytes_per_page"] == 8 * kv["bytes_per_token"]
    assert kv["capacity_tokens"] == 2 * 32 and kv["cache_bytes"] == (2 * 4 + 1) * kv["bytes_per_page"]
    live = kv["live_tokens"]  # each slot holds the pages of its tokens so far, at most cache_length's 4
    assert -(-live // 8) <= kv["held_pages"] <= 2 * 4
    assert kv["bytes_per_live_token"] == kv["held_pages"] * kv["bytes_per_page"] / live
    assert kv["capacity_sequences_at_mean_length"] == int(64 // kv["mean_length"])
    assert "paged worker vs dense worker" in format_table(results)
