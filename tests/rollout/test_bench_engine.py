"""`bench engine` on a very small configuration: the schema of engine.json and no recompiles."""

from __future__ import annotations

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
