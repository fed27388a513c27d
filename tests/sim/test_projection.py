"""compile.json -> cost model (checked by hand), errors naming the file and key, a tiny projection run."""

import copy
import json

import numpy as np
import pytest

from configs.sim_paper import get_config
from dora_jax.sim import Mode
from dora_jax.sim.projection import LABEL, bucket_positions, project, read_compile_json, read_estimates, train_cost
from dora_jax.sim.report import format_table, run_projection
from dora_jax.trainer.batching import bucket_length

# The structure of tpu_compile's output (roles, programs, resident_breakdown, config), tiny numbers.
# Trainer widths (length_bucket 32, cache 96): 32, 64, 96; XLA estimated only T=64.
_CONFIG = {
    "mesh": {"time_shared": False},
    "rollout": {"num_slices": 2, "slots": 8, "cache_length": 96, "max_new_tokens": 64},
    "coordinator": {
        "k_max": 2,
        "group_size": 4,
        "train_batch_size": 16,
        "rollout_batch_size": 32,
        "rebalance_period_s": 5.0,
    },
    "trainer": {"num_updates": 2, "length_bucket": 32},
    "task": {"source": {"max_prompt_tokens": 32}},
    "pod": {"name": "tiny", "trainer_type": "v5p-8", "rollout_type": "v5p-8"},
}


def _program(name, estimated_s, **extra):
    return dict(name=name, estimated_s=estimated_s, estimate="xla" if estimated_s else "not estimated", **extra)


_TRAINER = {
    "role": "trainer",
    "chips": 4,
    "resident_breakdown": {"params": 10, "optimizer_state": 20},
    "programs": [
        _program("recompute[rows=2,T=32]", None, model_flops=0.3e9),
        _program("grad[rows=4,T=32]", None, model_flops=1.0e9),
        _program("recompute[rows=2,T=64]", 0.004, model_flops=0.7e9),
        _program("grad[rows=2,T=64]", 0.02, model_flops=2.0e9),
        _program("recompute[rows=2,T=96]", None, model_flops=1.1e9),
        _program("grad[rows=2,T=96]", None, model_flops=3.2e9),
        _program("grad_sum", 0.001),
        _program("optimizer_update", 0.005),
    ],
}
_ROLLOUT = {
    "role": "rollout",
    "chips": 4,
    # decode_state per chip x 4 chips / (8 slots x 96 positions) = 1000 bytes per token
    "resident_breakdown": {"params": 1_000_000_000, "decode_state": 192_000},
    "programs": [
        _program("prefill[T=16]", 0.001),
        _program("prefill[T=32]", 0.0016),
        _program("generate", 0.01),
        _program("insert[rows=32]", 1e-6),
        _program("read_slot[rows=32]", 1e-5),
    ],
}


def _write(tmp_path, name, roles, config=_CONFIG):
    path = tmp_path / name / "compile.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": config, "roles": roles, "fits": True}))
    return str(path)


def _files(tmp_path, trainer=_TRAINER, rollout=_ROLLOUT, config=_CONFIG):
    return [_write(tmp_path, "trainer", [trainer], config), _write(tmp_path, "rollout", [rollout], config)]


def _sim_config(steps=3, warmup=1, modes=("sync", "dora")):
    c = get_config()
    with c.unlocked():
        c.run.steps, c.run.warmup, c.run.modes = steps, warmup, modes
    return c


def test_mapping_by_hand(tmp_path):
    p = project(_sim_config(), _files(tmp_path))
    costs, w, e = p.scenario.costs, p.scenario.workload, p.estimates
    assert costs.decode.t0_s == 0.01 and costs.decode.t1_s == 0.0  # fixed-shape step over every slot
    assert costs.prefill_s_per_token == pytest.approx(0.0016 / 32)  # the largest bucket
    assert costs.weight_load_s == pytest.approx(1e9 * 4 / 5e9)  # params x chips / weight_load_bytes_per_s
    assert costs.kv_bytes_per_token == pytest.approx(1000.0)
    assert costs.migrate_bytes_per_s == 1e9
    assert costs.train_fixed_s == pytest.approx(2 * 0.005)  # num_updates x optimizer_update
    assert costs.train_s_per_token == pytest.approx(4 * p.train.s_per_token)  # chip-seconds: x trainer chips
    assert (costs.accelerators_per_group, costs.slots_per_group) == (4, 8)
    # Unestimated widths: the estimated width's seconds per model flop (0.02 / 2e9; 0.004 / 0.7e9).
    assert e.width(96).grad_s == pytest.approx(3.2e9 * 0.02 / 2e9)
    assert e.width(32).recompute_s == pytest.approx(0.3e9 * 0.004 / 0.7e9)
    assert e.width(64).estimated and not e.width(96).estimated
    assert e.width(64).s_per_position(e.grad_sum_s) == pytest.approx((0.02 + 0.001) / 128 + 0.004 / 128)
    # Workload: TBS 16 samples = 4 prompts x 4; the paper's median / max = 2400 / 30720 at max 64.
    assert (w.prompts_per_step, w.samples_per_prompt, w.prompt_tokens, w.max_response) == (4, 4, 32, 64)
    assert w.median_response == pytest.approx(64 * 2400 / 30720)
    assert (p.scenario.options.k_max, p.scenario.options.rbs(w), p.scenario.options.rebalance_period_s) == (2, 32, 5.0)
    assert p.scenario.settings == (4 + 2 * 4,)
    # Every sample is 33..96 tokens: padded to 64 or 96, so padding is between 1 and 64 / 33.
    assert 1.0 < p.train.padding_factor < 64 / 33
    assert p.train.s_per_token == pytest.approx(p.train.s_per_position * p.train.padding_factor)


def test_train_cost_by_hand(tmp_path):
    config, roles = read_compile_json(_files(tmp_path))
    e = read_estimates(config, roles, ["x"])
    cost = train_cost(e, np.array([40, 60, 70, 96]))  # buckets 64, 64, 96, 96
    s64 = (0.02 + 0.001) / (2 * 64) + 0.004 / (2 * 64)
    s96 = (0.032 + 0.001) / (2 * 96) + (1.1e9 * 0.004 / 0.7e9) / (2 * 96)
    seconds = 2 * 64 * s64 + 2 * 96 * s96
    assert cost.s_per_token == pytest.approx(seconds / 266)
    assert cost.padding_factor == pytest.approx((2 * 64 + 2 * 96) / 266)
    assert cost.recompute_s_per_token == pytest.approx((2 * 0.004 / 2 + 2 * (1.1e9 * 0.004 / 0.7e9) / 2) / 266)


def test_sampler_behaviour_logps_compile_and_charge_no_recompute(tmp_path):
    """trainer.behaviour_logps = "sampler": tpu_compile lowers no recompute program (the trainer
    never runs one), and the cost model reads the grad programs alone and charges no recompute;
    the same files without that setting are refused, naming the missing program."""
    trainer = copy.deepcopy(_TRAINER)
    trainer["programs"] = [p for p in trainer["programs"] if not p["name"].startswith("recompute[")]
    sampler = copy.deepcopy(_CONFIG)
    sampler["trainer"]["behaviour_logps"] = "sampler"
    config, roles = read_compile_json(_files(tmp_path / "sampler", trainer=trainer, config=sampler))
    e = read_estimates(config, roles, ["x"])
    assert [(w.width, w.recompute_s) for w in e.train_widths] == [(32, 0.0), (64, 0.0), (96, 0.0)]
    assert e.width(64).estimated and not e.width(96).estimated
    assert e.width(64).s_per_position(e.grad_sum_s) == pytest.approx((0.02 + 0.001) / 128)
    cost = train_cost(e, np.array([40, 60, 70, 96]))
    s96 = (0.032 + 0.001) / (2 * 96)
    assert cost.s_per_token == pytest.approx((2 * 64 * (0.021 / 128) + 2 * 96 * s96) / 266)
    assert cost.recompute_s_per_token == 0.0
    with pytest.raises(ValueError, match=r"trainer/compile.json: the trainer role has no recompute\[rows=R,T=T\]"):
        read_estimates(
            *read_compile_json(_files(tmp_path / "trainer", trainer=trainer)),
            [str(tmp_path / "trainer" / "trainer" / "compile.json")],
        )


def test_bucket_positions_match_the_trainer():
    lengths = np.arange(1, 641)
    want = [bucket_length(int(n), 64, cap=640) for n in lengths]
    assert bucket_positions(lengths, 64, 640).tolist() == want
    with pytest.raises(ValueError, match="cache_length=640"):
        bucket_positions(np.array([641]), 64, 640)


def test_missing_role_names_the_files_and_the_command(tmp_path):
    only_trainer = [_write(tmp_path, "trainer", [_TRAINER])]
    with pytest.raises(ValueError, match=r"rollout role.*--roles=rollout"):
        project(_sim_config(), only_trainer)


def test_missing_or_unestimated_program_names_file_and_program(tmp_path):
    rollout = copy.deepcopy(_ROLLOUT)
    rollout["programs"] = [p for p in rollout["programs"] if p["name"] != "generate"]
    files = _files(tmp_path, rollout=rollout)
    with pytest.raises(ValueError, match=rf"{files[1]}: the rollout role has no program 'generate'"):
        project(_sim_config(), files)
    trainer = copy.deepcopy(_TRAINER)
    for program in trainer["programs"]:
        if program["name"].startswith("grad["):
            program["estimated_s"] = None
    files = _files(tmp_path, trainer=trainer)
    with pytest.raises(ValueError, match=rf"{files[0]}: no grad\[...\] program has an estimate"):
        project(_sim_config(), files)
    trainer = copy.deepcopy(_TRAINER)
    trainer["programs"] = [p for p in trainer["programs"] if p["name"] != "optimizer_update"]
    with pytest.raises(ValueError, match="no program 'optimizer_update'"):
        project(_sim_config(), _files(tmp_path, trainer=trainer))


def test_config_problems_name_the_key(tmp_path):
    config = copy.deepcopy(_CONFIG)
    del config["rollout"]["slots"]
    with pytest.raises(ValueError, match="no 'rollout.slots'"):
        project(_sim_config(), _files(tmp_path, config=config))
    other = copy.deepcopy(_CONFIG)
    other["rollout"]["slots"] = 16
    files = [_write(tmp_path, "trainer", [_TRAINER]), _write(tmp_path, "rollout", [_ROLLOUT], other)]
    with pytest.raises(ValueError, match="different configs"):
        project(_sim_config(), files)
    files = [_write(tmp_path, "a", [_TRAINER]), _write(tmp_path, "b", [_TRAINER, _ROLLOUT])]
    with pytest.raises(ValueError, match="role 'trainer' is also in"):
        project(_sim_config(), files)


def test_tiny_projection_runs_dora_and_sync_with_audit_ok(tmp_path):
    results = run_projection(project(_sim_config(), _files(tmp_path)), str(tmp_path / "out"))
    on_disk = json.loads((tmp_path / "out" / "results.json").read_text())
    assert on_disk["kind"] == "projection" and on_disk["label"] == LABEL and "estimated" in on_disk["unit"]
    assert on_disk["projection"]["estimated"]["decode_step_s"] == 0.01
    assert on_disk["projection"]["assumed"]["migrate_bytes_per_s"] == 1e9
    setting = on_disk["settings"]["12"]
    assert set(setting["modes"]) == {Mode.SYNC.value, Mode.DORA.value}
    for mode in setting["modes"].values():
        assert mode["audit_ok"] and mode["step_time_s"] > 0 and mode["steps"] == 2
    assert setting["modes"]["sync"]["max_staleness"] == 0 and setting["modes"]["dora"]["max_staleness"] <= 2
    assert setting["placement"]["sync"] == dict(
        placement="split", rollout_groups=2, rollout_accelerators=8, train_accelerators=4
    )
    assert "dora_vs_sync" in setting["ratios"]
    assert on_disk["notes"][0].startswith(LABEL)
    table = format_table(results)
    assert table.startswith(LABEL) and "12 chips" in table
