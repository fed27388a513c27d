"""Ahead-of-time compilation for TPU topologies on this CPU machine (dora_jax.runtime.aot and the
`python -m dora_jax.tpu_compile` command): a tiny model's programs compile for a v5e:2x2 and fit,
a huge one is reported as not fitting with the program named, bad input is refused by name."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dora_jax.runtime import aot, run_config
from tests.helpers import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ROLE_KEYS = {
    "role",
    "topology",
    "chips",
    "hbm_capacity_bytes_per_chip",
    "resident_bytes_per_chip",
    "peak_bytes_per_chip",
    "fits",
    "programs",
}
PROGRAM_KEYS = {
    "name",
    "argument_bytes",
    "output_bytes",
    "temp_bytes",
    "alias_bytes",
    "flops",
    "bytes_accessed",
    "estimated_s",
}


# 2 layers of 3.5B params each: 28 GB of fp32 weights, more than one 16 GiB v5e chip holds
HUGE = {"hidden_size": 16384, "intermediate_size": 65536, "num_heads": 128, "num_kv_heads": 16, "head_dim": 128}


def _config(**model):
    """The smoke config shrunk to a 2-layer model and short rows: 2 trainer chips + 2 rollout chips."""
    c = tiny_config("dora")
    with c.unlocked():
        c.rollout.num_slices = 2
        c.rollout.cache_length = 32
        c.rollout.max_prefill_length = 16
        c.rollout.max_new_tokens = 24
        c.trainer.length_bucket = 0  # one whole-batch train step (T = 32)
        for field, value in model.items():
            setattr(c.model, field, value)
    return c


def test_accelerator_types_map_to_topologies():
    assert aot.topology_of_type("v5p-32", "pod.trainer_type") == "v5p:2x2x4"
    assert aot.topology_of_type("v5p-8", "pod.rollout_type") == "v5p:2x2x1"
    assert aot.topology_of_type("v5litepod-8", "pod.trainer_type") == "v5e:2x4"
    assert aot.topology_of_type("v6e-256", "pod.trainer_type") == "v6e:16x16"
    assert aot.topology_of_type("v4-16", "pod.trainer_type") == "v4:2x2x2"
    with pytest.raises(ValueError, match=r"pod.trainer_type='v5p-33'.*power of two"):
        aot.topology_of_type("v5p-33", "pod.trainer_type")
    with pytest.raises(ValueError, match=r"pod.rollout_type='tpu9-8' is not a known TPU accelerator type"):
        aot.topology_of_type("tpu9-8", "pod.rollout_type")


@pytest.mark.slow  # the TPU compiler takes ~5-45 s a program on 2 cores
def test_a_tiny_model_compiles_for_v5e_and_fits():
    config = run_config.parse(_config())
    result = aot.compile_roles(config, None, "v5e:2x2")
    assert result["fits"] is True
    trainer, rollout = result["roles"]
    for role in result["roles"]:
        assert ROLE_KEYS <= set(role)
        assert role["topology"] == "v5e:2x2" and role["hbm_capacity_bytes_per_chip"] == 16 * 2**30
        assert 0 < role["resident_bytes_per_chip"] < role["peak_bytes_per_chip"] < 2**30
        for program in role["programs"]:
            assert PROGRAM_KEYS <= set(program), program
            assert program["argument_bytes"] > 0 and program["estimated_s"] > 0
    assert (trainer["role"], trainer["chips"], rollout["role"], rollout["chips"]) == ("trainer", 2, "rollout", 1)
    step = trainer["programs"][0]
    assert step["name"] == "train_step[B=8,U=1,M=1,C=8,T=32]"
    assert step["flops"] > 0 and step["bytes_accessed"] > 0 and step["model_flops"] > 0
    names = [p["name"] for p in trainer["programs"] + rollout["programs"]]
    # The paged KV cache (16-row pages): the reference attention runs at each live-page width.
    expected = ["train_step[B=8,U=1,M=1,C=8,T=32]", "recompute[C=8,T=32]", "prefill[T=16]", "generate[pages=1]"]
    expected += ["generate", "insert[rows=16]", "read_slot[rows=16]", "insert[rows=32]", "read_slot[rows=32]"]
    assert names == expected
    assert rollout["kv_page_size"] == 16 and rollout["cache_length"] == 32
    assert rollout["kv_pool_tokens"] == 4 * 32  # 16 GiB sizes more, capped at every slot full (4 slots)
    # The migration rule on the compiled prefill estimates: 4 tokens re-prefill in one 16-token
    # chunk, 16 and 30 (the longest) in two; the smoke config knows no link rate, so KV moves.
    prefill = next(p for p in rollout["programs"] if p["name"] == "prefill[T=16]")["estimated_s"]
    rule = rollout["migration_rule"]
    assert [r["prefix_tokens"] for r in rule] == [4, 16, 30]
    assert [r["reprefill_s_estimate"] for r in rule] == pytest.approx([prefill, 2 * prefill, 2 * prefill])
    assert [r["kv_bytes_moved"] for r in rule] == [16 * 512, 16 * 512, 32 * 512]  # 2 layers x k, v x 2 x 16 x 4 B
    assert all(r["kv_s_at_link"] is None and r["rule"] == "kv" for r in rule)
    assert aot.does_not_fit(result) == []
    json.dumps(result)  # compile.json's content

    # XLA's cost analysis counts a scan body once: with model.scan_layers the train step's cost is
    # extrapolated from unrolled 1- and 2-block compiles, and matches the unrolled program's.
    scanned = aot.compile_roles(run_config.parse(_config(scan_layers=True)), None, "v5e:2x2", roles=("trainer",))
    assert scanned["fits"] is True
    for plain, scan in zip(trainer["programs"], scanned["roles"][0]["programs"]):
        assert scan["name"] == plain["name"] and "layers extrapolated" in scan["estimate"]
        assert scan["flops"] == pytest.approx(plain["flops"], rel=0.02)
        assert scan["bytes_accessed"] == pytest.approx(plain["bytes_accessed"], rel=0.1)


@pytest.mark.slow  # the TPU compiler takes ~5-45 s a program on 2 cores
def test_the_rollout_role_compiles_its_scoring_program_when_slices_score():
    """trainer.behaviour_logps = "rollout": the rollout role also compiles the slice's scoring of
    finished trajectories (the trainer's forward, the trainer's recompute chunk of rows, the whole
    cache's positions), with its memory and an estimate that keeps to its flops floor."""
    c = _config()
    with c.unlocked():
        c.trainer.behaviour_logps = "rollout"
        c.trainer.micro_batch_size = 2  # fewer rows a call than the slice's 4 slots
    config = run_config.parse(c)
    result = aot.compile_roles(config, None, "v5e:2x2", roles=("rollout",))
    assert result["fits"] is True
    (rollout,) = result["roles"]
    score = rollout["programs"][-1]
    assert score["name"] == "score[rows=2,T=32]"
    assert [p["name"] for p in rollout["programs"]].count(score["name"]) == 1
    cfg = aot.model_config(config)
    assert score["model_flops"] == pytest.approx(aot.train_model_flops(cfg, 2, 32) / 3.0)  # one chip
    assert score["estimated_s"] >= score["model_flops"] / aot.CHIPS["v5e"].peak_flops
    assert 0 < score["argument_bytes"] and rollout["peak_bytes_per_chip"] < 2**30


@pytest.mark.slow  # the TPU compiler takes ~5-45 s a program on 2 cores
def test_moe_expert_projections_compile_to_the_megablox_kernels():
    """A tiny MoE (8 experts, top 2) trainer compiled for TPU on fsdp 1 x expert 2: with "grouped"
    the compiler expands the experts' weight gradients densely over every expert (XLA counts more
    than twice what is due); with "megablox" every expert projection is a megablox kernel under
    expert parallelism and XLA's count (the kernels' own cost estimates included) falls to under
    half of grouped's, for the same work due. The rollout role (a slice of tensor 2: the experts'
    width split) compiles every engine program with the kernels placed per device too."""
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True)
    steps = {}
    for dispatch in ("grouped", "megablox"):
        c = _config(moe_dispatch=dispatch, **moe)
        with c.unlocked():
            c.mesh.trainer = ml_collections.ConfigDict({"fsdp": 1, "expert": 2})
            c.rollout.num_slices = 1
            c.mesh.rollout = ml_collections.ConfigDict({"tensor": 2})
        roles = ("trainer", "rollout") if dispatch == "megablox" else ("trainer",)
        result = aot.compile_roles(run_config.parse(c), None, "v5e:2x2", roles=roles)
        assert result["fits"] is True
        for role in result["roles"]:
            assert [p["name"] for p in role["programs"] if "error" in p] == []
        steps[dispatch] = result["roles"][0]["programs"][0]
    grouped, megablox = steps["grouped"], steps["megablox"]
    assert grouped["name"] == megablox["name"] == "train_step[B=8,U=1,M=1,C=8,T=32]"
    assert megablox["flops_due"] == grouped["flops_due"]
    assert megablox["kernel_flops"] == grouped["kernel_flops"]  # the attention kernel's alone
    assert grouped["flops"] > 2 * grouped["flops_due"]
    assert megablox["flops"] < 0.5 * grouped["flops"]


@pytest.mark.slow  # the TPU compiler takes ~5-45 s a program on 2 cores
def test_a_huge_model_does_not_fit_and_the_program_is_named():
    c = _config(**HUGE)
    config = run_config.parse(c)
    result = aot.compile_roles(config, None, "v5e:2x2", roles=("rollout",))
    (rollout,) = result["roles"]
    assert result["fits"] is False and rollout["fits"] is False
    assert rollout["peak_bytes_per_chip"] > rollout["hbm_capacity_bytes_per_chip"]
    (line,) = aot.does_not_fit(result)
    assert line.startswith(f"rollout on v5e:2x2 does not fit: {rollout['largest_program']} needs")
    assert "GiB HBM" in line and "more chips (pod.rollout_type, mesh.rollout)" in line


@pytest.mark.slow  # the TPU compiler
def test_programs_compiles_only_the_named_programs_and_claims_no_fit_only_a_misfit():
    """`programs`: the named programs alone (by the name before "["), every one of that name; with
    programs left out the role's peak is not known, so no fit is claimed, only a misfit: programs
    that already exceed the chip."""
    config = run_config.parse(_config())
    lines = []
    result = aot.compile_roles(config, None, "v5e:2x2", roles=("rollout",), programs=["generate"], log=lines.append)
    (rollout,) = result["roles"]
    names = [p["name"] for p in rollout["programs"]]
    assert names and all(name.split("[")[0] == "generate" for name in names), names
    assert result["fits"] is None and rollout["fits"] is None and rollout["programs_selected"] == ["generate"]
    assert any(line.startswith("  left out (--programs=generate): ") and "prefill" in line for line in lines), lines
    assert aot.does_not_fit(result) == []
    assert aot.unknown_programs(result, ["generate"]) is None
    wrong = aot.unknown_programs(result, ["generate", "genrate"])
    assert (
        wrong.startswith("--programs: genrate is no program of the roles compiled; they have ") and "prefill" in wrong
    )
    huge = _config(**HUGE)  # does not fit, whatever else compiles
    result = aot.compile_roles(
        run_config.parse(huge), None, "v5e:2x2", roles=("rollout",), programs=["prefill"], log=lambda _: None
    )
    assert result["fits"] is False and result["roles"][0]["fits"] is False
    (line,) = aot.does_not_fit(result)
    assert line.startswith("rollout on v5e:2x2 does not fit: prefill[")


@pytest.mark.slow  # two processes that load libtpu
def test_the_command_takes_programs_through_its_role_processes_and_names_a_typo(tmp_path):
    """--programs reaches both role processes (--jobs=2): the rollout's generate programs compile, the
    trainer's none; a name that is neither role's program exits 2 naming it once (the parent's check)."""
    from tests.helpers import CONFIG

    small = ["--config.rollout.num_slices=2", "--config.rollout.cache_length=32"]
    small += ["--config.rollout.max_prefill_length=16", "--config.rollout.max_new_tokens=24"]
    result = subprocess.run(
        [sys.executable, "-m", "dora_jax.tpu_compile", f"--config={CONFIG}", f"--out={tmp_path}", "--target=v5e:2x2"]
        + small
        + ["--programs=generate,genrate"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.count("tpu_compile: --programs: genrate is no program of the roles compiled") == 1
    with open(tmp_path / "compile.json") as f:
        written = json.load(f)
    assert written["fits"] is None
    programs = {r["role"]: [p["name"].split("[")[0] for p in r["programs"]] for r in written["roles"]}
    assert programs["trainer"] == [] and programs["rollout"] and set(programs["rollout"]) == {"generate"}


def test_what_would_fit_names_the_fields_and_the_share():
    gib = 2**30
    program = {"name": "grad[rows=16,T=9216]", "temp_bytes": 160 * gib, "output_bytes": 0, "alias_bytes": 0}
    role = {
        "role": "trainer",
        "topology": "v5p:2x2x4",
        "hbm_capacity_bytes_per_chip": 95 * gib,
        "resident_bytes_per_chip": 15 * gib,
        "resident_breakdown": {"params": 15 * gib},
        "peak_bytes_per_chip": 175 * gib,
        "largest_program": program["name"],
        "fits": False,
        "programs": [program],
    }
    (line,) = aot.does_not_fit({"roles": [role]})
    assert "trainer.micro_batch_tokens" in line and "about 0.50x of it would fit" in line
    kv = {"params": 4 * gib, "decode_state": 100 * gib}
    rollout = dict(role, role="rollout", resident_bytes_per_chip=104 * gib, resident_breakdown=kv)
    assert (
        "the resident state alone is 104.00 GiB: more chips (pod.rollout_type"
        in aot.does_not_fit({"roles": [rollout]})[0]
    )
    program = dict(program, name="generate", temp_bytes=1 * gib)
    rollout = dict(
        rollout, resident_bytes_per_chip=94 * gib, resident_breakdown={"params": 4 * gib, "decode_state": 90 * gib}
    )
    rollout["programs"] = [program]
    (line,) = aot.does_not_fit({"roles": [dict(rollout, largest_program="generate", peak_bytes_per_chip=95 * gib + 1)]})
    assert "KV cache (rollout.slots x rollout.cache_length) takes 90.00 GiB: about 1.00x of it would fit" in line


def test_bad_topologies_and_meshes_are_refused_by_name():
    config = run_config.parse(_config())
    with pytest.raises(ValueError, match=r"--target='v9z:2x2' is not a TPU topology"):
        aot.plan_roles(config, None, "v9z:2x2")
    pod = ml_collections.ConfigDict({"layout": "slices", "trainer_type": "v5litepod-4", "rollout_type": "v5litepod-1"})
    with pytest.raises(
        ValueError, match=r"mesh.trainer=\{'fsdp': 2\} spans 2 chips but pod.trainer_type='v5litepod-4' has 4"
    ):
        aot.plan_roles(config, pod, "pod")
    with pytest.raises(ValueError, match="the config has no `pod` section"):
        aot.plan_roles(config, None, "pod")


def test_without_libtpu_the_install_command_is_named(monkeypatch):
    monkeypatch.setattr(aot.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r'pip install -e "\.\[tpu\]"'):
        aot.topology_devices("v5e:2x2", "--target")


def test_the_command_names_a_bad_target_without_a_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "dora_jax.tpu_compile", "--config=configs/smoke.py", f"--out={tmp_path}"]
        + ["--target=v5e:3x3"],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "tpu_compile: --target='v5e:3x3'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow  # both roles of the smoke model compiled twice: ~1 min on 2 cores
def test_the_command_compiles_the_roles_in_two_processes_as_one_process_does(tmp_path):
    """--jobs=2 (the default): each role in a process of its own, progress lines prefixed with the
    role; the rollout's process also compiles the trainer's cost probes (scanned blocks) and hands
    their costs over; compile.json holds the roles in order with the records `compile_roles` makes
    in one process."""
    from tests.helpers import CONFIG, smoke_config

    # 2 + 2 chips; one train step shape; blocks under scan, so the step's cost comes from probes; rows of
    # 32 tokens (the smoke config's 256 took 84 s here for the test, 38 s with these)
    overrides = {"rollout.num_slices": 2, "trainer.length_bucket": 0, "model.scan_layers": True}
    overrides |= {"rollout.cache_length": 32, "rollout.max_prefill_length": 16, "rollout.max_new_tokens": 24}
    result = subprocess.run(
        [sys.executable, "-m", "dora_jax.tpu_compile", f"--config={CONFIG}", f"--out={tmp_path}", "--target=v5e:2x2"]
        + [f"--config.{field}={value}" for field, value in overrides.items()],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[trainer]   train_step[" in result.stderr and "[rollout]   generate" in result.stderr
    assert re.search(r"\[rollout\]   train_step\[\S+\]: cost probes \(1 and 2 blocks\) compiled", result.stderr)
    with open(tmp_path / "compile.json") as f:
        written = json.load(f)
    c = smoke_config()
    with c.unlocked():
        c.update_from_flattened_dict(overrides)
    expected = aot.compile_roles(run_config.parse(c), None, "v5e:2x2", log=lambda line: None)
    assert written["fits"] is True and [r["role"] for r in written["roles"]] == ["trainer", "rollout"]
    for ours, theirs in zip(written["roles"], expected["roles"], strict=True):
        assert [p["name"] for p in ours["programs"]] == [p["name"] for p in theirs["programs"]]
        assert ours["peak_bytes_per_chip"] == theirs["peak_bytes_per_chip"]
        for a, b in zip(ours["programs"], theirs["programs"], strict=True):
            assert (a["temp_bytes"], a["flops"], a["estimate"]) == (b["temp_bytes"], b["flops"], b["estimate"])
    assert "layers extrapolated" in written["roles"][0]["programs"][0]["estimate"]


@pytest.mark.slow  # a process that loads libtpu
def test_the_command_names_a_role_that_does_not_fit_once(tmp_path):
    """Roles compiled in processes of their own that do not fit: exit 1, each named once (by the
    merged result, not again by its process)."""
    from tests.helpers import CONFIG

    result = subprocess.run(
        [sys.executable, "-m", "dora_jax.tpu_compile", f"--config={CONFIG}", f"--out={tmp_path}", "--target=v5e:2x2"]
        + ["--jobs=2", "--config.rollout.num_slices=2", "--config.rollout.cache_length=32"]
        # the trainer's grad programs only (no behaviour recompute to compile)
        + ["--config.trainer.behaviour_logps=sampler"]
        + ["--config.rollout.max_prefill_length=16", "--config.rollout.max_new_tokens=24"]
        + [f"--config.model.{field}={value}" for field, value in HUGE.items()],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    for role in ("trainer", "rollout"):
        assert result.stderr.count(f"{role} on v5e:2x2 does not fit") == 1, result.stderr[-3000:]
        assert f"[{role}] {role} on v5e:2x2" in result.stderr


@pytest.mark.slow  # the TPU compiler takes ~5-45 s a program on 2 cores
@pytest.mark.parametrize("head_dim", [128, 64])
def test_the_paged_decode_step_compiles_with_the_ragged_paged_attention_kernel(head_dim):
    """A model whose heads are 128 wide, or 64 wide and packed two to a row of the pool (as
    Qwen2.5-0.5B's), decodes with the TPU kernel: one page-table width (the kernel reads only live
    pages), the kernel in the compiled program, and the pool sized from the chip's HBM by
    kv_memory_fraction (capped at every slot full)."""
    c = _config(hidden_size=256, num_heads=2, num_kv_heads=2, head_dim=head_dim, attention="pallas_tpu")
    with c.unlocked():
        c.rollout.cache_length = 256
        c.rollout.max_prefill_length = 64
        c.rollout.max_new_tokens = 128
        c.rollout.page_size = 16
    config = run_config.parse(c)
    (target,) = [t for t in aot.plan_roles(config, None, "v5e:2x2") if t.role == "rollout"]
    cfg = aot.model_config(config)
    engine = aot.RolloutEngine(cfg, config.rollout.engine_config(), target.mesh, hbm_bytes=16 * 2**30)
    assert engine.paged_kernel and engine.config.num_pages == 4 * 16 + 1
    pool = engine.abstract_decode_state().cache[0]
    assert pool.shape == (4 * 16 + 1, 16, 4 // (128 // head_dim), 128)  # [P, N, 2K', 128 lanes]
    (generate,) = [lowered for name, lowered in engine.lower_programs() if name.startswith("generate")]
    assert "ragged_paged_attention" in generate.as_text()
    compiled = generate.compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 2**20  # no copy of the pool (4 x 256 rows)


def test_probe_costs_handed_over_in_a_file_or_the_other_process_failure_named(tmp_path):
    """The trainer's process waits for the cost probes another process writes (whole, by rename),
    and stops waiting with the other process's failure, by file and reason."""
    path = str(tmp_path / "probes.json")
    costs = aot.read_probe_costs(path, poll_s=0.01)
    writer = threading.Timer(0.2, lambda: aot.write_probe_costs(path, costs={"grad[T=8]": [[1, 2, 3], [4, 5, 6]]}))
    writer.start()
    assert costs("grad[T=8]") == [[1, 2, 3], [4, 5, 6]]  # waited for the file
    with pytest.raises(RuntimeError, match=r"holds no cost probes for recompute\[T=8\]; it has \['grad\[T=8\]'\]"):
        costs("recompute[T=8]")
    aot.write_probe_costs(path, error="the rollout role's process exited with 2 first")
    with pytest.raises(RuntimeError, match=r"failed in the other process \(.*probes.json\): the rollout role's"):
        aot.read_probe_costs(path)("grad[T=8]")


@pytest.mark.parametrize("rows, binds", [(1024, "flops"), (8, "bytes")])
def test_an_estimate_is_never_below_either_floor(rows, binds):
    """A stack of 8 weight matrices multiplied through under `lax.scan`, compiled for one v5e chip:
    XLA's cost analysis counts the scan's body once (an eighth of the flops and of the weights), so
    its own roofline is below what the program must do. The record's time is at least the model
    flops at the chip's peak and the weights read once plus the output written at HBM bandwidth,
    both computed here from the shapes; 1024 rows bind on flops, 8 rows (a decode step) on bytes;
    the MFU is at most 100%."""
    layers, width = 8, 1024
    (device,) = aot.topology_devices("v5e:2x2", "--target")[:1]
    one = NamedSharding(Mesh(np.array([device]), ("x",)), PartitionSpec())

    def forward(x_RK, w_LKK):
        return jax.lax.scan(lambda x, w: (x @ w, None), x_RK, w_LKK)[0]

    x = jax.ShapeDtypeStruct((rows, width), jnp.bfloat16, sharding=one)
    w = jax.ShapeDtypeStruct((layers, width, width), jnp.bfloat16, sharding=one)
    lowered = jax.jit(forward, out_shardings=one).lower(x, w)
    model_flops = 2.0 * rows * width * width * layers
    weights = layers * width * width * 2  # bf16
    program = aot.Program("stack", lambda: lowered, model_flops=model_flops, weight_bytes=weights)
    chip = aot.CHIPS["v5e"]
    record = aot.compile_program(program, chip, log=lambda line: None)

    assert record["flops"] < model_flops / 4  # XLA counted the scan's body once
    flops_floor = model_flops / 197e12  # v5e: 197 TFLOP/s bf16
    bytes_floor = (weights + rows * width * 2) / 819e9  # v5e: 819 GB/s; the [rows, width] bf16 output
    assert record["flops_floor_s"] == pytest.approx(flops_floor)
    assert record["bytes_floor_s"] == pytest.approx(bytes_floor)
    assert record["estimated_s"] >= max(flops_floor, bytes_floor)
    assert record["floor"] == binds and record["estimate"].startswith(f"{binds} floor")
    assert record["mfu"] <= 1.0
    row = aot.table({"roles": [dict(_ROLE, programs=[record])]}).splitlines()[-1]
    assert f"{record['estimated_s'] * 1e3:.2f} {binds}" in row and "MFU" in row


_ROLE = {
    "role": "trainer",
    "topology": "v5e:2x2",
    "chips": 1,
    "resident_bytes_per_chip": 0,
    "peak_bytes_per_chip": 0,
    "hbm_capacity_bytes_per_chip": 16 * 2**30,
    "fits": True,
}


def test_an_mfu_above_100_percent_is_an_error_naming_the_program():
    """The flops floor makes an MFU above 100% impossible; were it ever computed, the program is
    named instead of the figure printed."""
    program = aot.Program("grad[rows=16,T=4096]", lambda: None, model_flops=2 * 197e12)  # 2 s of model flops
    record = {"output_bytes": 0, "alias_bytes": 0}
    chip = aot.CHIPS["v5e"]
    out = aot._estimate(program, record, chip, (1.0, 1.0, 0.5), "xla")  # XLA: 0.5 s
    assert out["estimated_s"] == pytest.approx(2.0) and out["mfu"] == pytest.approx(1.0)
    assert out["estimate"] == "flops floor (the estimate, xla, was below it)"
    with pytest.raises(AssertionError, match=r"grad\[rows=16,T=4096\]: MFU 200.0% > 100%"):
        aot.mfu_of(program, 1.0, chip)  # a time below the flops floor


LLAMA_3_1_8B = {  # meta-llama/Llama-3.1-8B config.json, the published architecture values
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}


@pytest.mark.slow  # 3 TPU compiles of 8B-wide layers: ~1-2 min on 2 shared cores
def test_llama_3_1_8b_on_v6e_estimates_within_its_floors(tmp_path):
    """Llama-3.1-8B (its config.json, 2 of its 32 layers) with the 7B config's settings on a v6e-16
    trainer (fsdp 16), at 1K-token rows (batches padded to 1K): the behaviour recompute's time is at
    or above both floors and its MFU at most 100%, and its cost probes see the whole LM head (XLA's
    flops within 5% of those due: the recompute's vocabulary scan, counted once, read 105% MFU)."""
    (tmp_path / "config.json").write_text(json.dumps(dict(LLAMA_3_1_8B, num_hidden_layers=2)))
    spec = importlib.util.spec_from_file_location("dapo", os.path.join(ROOT, "configs", "qwen2_5_7b_dapo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    with c.unlocked():
        c.model.hf_path = str(tmp_path)
        c.pod.trainer_type, c.pod.rollout_type = "v6e-16", "v6e-4"
        c.rollout.cache_length, c.rollout.max_new_tokens = 1024, 512
        c.rollout.max_prefill_length = c.task.source.max_prompt_tokens = 512
        c.task.overlong_penalty_tokens = 102  # a fifth of the 512-token cap, as the config keeps it
        c.trainer.micro_batch_tokens = 16384  # 16 rows of 1K: one per chip
        # Batches and micro-batches 1K wide only: the 512-wide programs would be compiled for their
        # memory alone (not costed: blocks under scan), 76 of the test's 300 s.
        c.trainer.pad_to = c.trainer.length_bucket = 1024
    config = run_config.parse(c)
    # The behaviour recompute alone (what read 105%): compiling the grad too took 531 s of the full
    # suite's 1,674 s on this machine (the recompute ~45 s alone, the grad ~150 s).
    result = aot.compile_roles(
        config, c.pod, "pod", roles=("trainer",), estimate_lengths=[1024], programs=["recompute"], log=lambda _: None
    )
    (trainer,) = result["roles"]
    assert trainer["topology"] == "v6e:4x4" and trainer["chips"] == 16
    assert result["fits"] is None and trainer["fits"] is None  # not every program compiled: no verdict
    costed = [p for p in trainer["programs"] if p["estimated_s"] is not None]
    assert [p["name"] for p in trainer["programs"]] == [p["name"] for p in costed] == ["recompute[rows=16,T=1024]"]
    for p in costed:
        assert p["estimated_s"] >= max(p["flops_floor_s"], p["bytes_floor_s"]), p
        assert p.get("mfu", 0.0) <= 1.0, p
    recompute = next(p for p in costed if p["name"] == "recompute[rows=16,T=1024]")
    assert recompute["flops"] == pytest.approx(recompute["flops_due"], rel=0.05)
    assert recompute["model_flops"] == pytest.approx(recompute["flops_due"] + recompute["kernel_flops"])


def _local_trainer_programs(**trainer_fields):
    """(model config, trainer programs) of `_config()` with `trainer_fields` set, on local devices."""
    c = _config()
    with c.unlocked():
        for field, value in trainer_fields.items():
            setattr(c.trainer, field, value)
    config = run_config.parse(c)
    (target,) = [t for t in aot.plan_roles(config, None, "local") if t.role == "trainer"]
    cfg = aot.model_config(config)
    trainer = aot._abstract_trainer(cfg, target.mesh, config.trainer)
    return cfg, aot.trainer_programs(config, trainer, cfg, 2)


@pytest.mark.parametrize("vocab_chunk, loops", [(0, 0), (64, 1)])
def test_the_behaviour_recompute_slices_the_vocabulary_by_trainer_vocab_chunk(vocab_chunk, loops):
    """The recompute's forward takes `trainer.vocab_chunk`, as the gradient's does: a cost probe
    (vocab_chunk 0) holds no vocabulary scan for XLA to count once (before, the recompute walked the
    vocabulary in 8K slices whatever the trainer's setting: Llama-3.1-8B's LM head counted 0.46 of
    4.30 TFLOP per chip, MFU 105%)."""
    cfg, programs = _local_trainer_programs(vocab_chunk=vocab_chunk)
    assert cfg.vocab_size > 64
    (recompute,) = [p for p in programs if p.name.startswith("recompute")]
    assert len(re.findall(r"stablehlo\.while", recompute.lower().as_text())) == loops


def test_the_trainer_compiles_no_recompute_program_when_behaviour_logps_come_from_the_sampler():
    """trainer.behaviour_logps = "sampler": every row comes with its sampling log-probs, so the
    trainer role compiles (and is charged for) its gradient programs alone."""
    names = {}
    for source in ("trainer", "sampler"):
        names[source] = [p.name for p in _local_trainer_programs(behaviour_logps=source)[1]]
    assert [n for n in names["trainer"] if n.startswith("recompute[")] == ["recompute[C=8,T=32]"]
    assert names["sampler"] == [n for n in names["trainer"] if not n.startswith("recompute[")] != []
