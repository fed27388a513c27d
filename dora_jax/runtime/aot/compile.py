"""Compiling each role's programs for its topology: the trainer's programs and their cost probes, one
program's record (`compile_program`), one role's (`compile_role`), every role's (`compile_roles`), and
the probes handed between two processes; the rollout slice's KV capacity and migration rule."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from dora_jax import models
from dora_jax.rollout.engine import KVPoolTooSmall, RolloutEngine
from dora_jax.rollout.migration import MigrationCosts
from dora_jax.runtime.aot.costs import (
    Program,
    _abstract,
    _bucketed_program,
    _cost,
    _estimate,
    _in_dtype,
    attention_kernel_flops,
    bytes_per_chip,
    hardware_flops,
    model_config,
    rollout_program,
    scoring_program,
    train_model_flops,
    transient_bytes,
    weight_bytes,
)
from dora_jax.runtime.aot.report import result_of
from dora_jax.runtime.aot.topology import Chip, GiB, RoleTarget, plan_roles
from dora_jax.runtime.roles.rollout import make_scorer
from dora_jax.runtime.run_config import RunConfig
from dora_jax.sim.projection import project_workload
from dora_jax.sim.workload import WorkloadSpec, mean_response
from dora_jax.trainer import Trainer
from dora_jax.trainer.bucketed import batch_widths


def trainer_programs(config: RunConfig, trainer: Trainer, cfg, chips: int, lengths=()) -> list[Program]:
    t, batch = config.trainer, config.coordinator.train_batch_size
    max_length = config.rollout.cache_length
    kernel = cfg.attention == "pallas_tpu"
    if t.length_bucket:
        widths = batch_widths(max_length, config.pad_to)  # as Trainer.warmup sees them
        return [
            _bucketed_program(name, lowered, cfg, chips, kernel)
            for name, lowered in trainer.lower_bucketed(batch, max_length, widths)
        ]
    lengths = sorted(set(lengths) | {max(batch_widths(max_length, config.pad_to))})  # the widest batch
    U, C = t.num_updates, t.micro_batch_size
    M = batch // (U * C)
    weights = weight_bytes(cfg, cfg.param_dtype, chips)  # the trainer's master weights, read every micro-batch
    programs = []
    for T in lengths:
        flops = train_model_flops(cfg, batch, T) / chips  # the whole batch: the record is scaled to it
        opaque = attention_kernel_flops(cfg, C, T, backward=True) / chips if kernel else 0.0  # one micro-batch
        programs.append(
            Program(
                f"train_step[B={batch},U={U},M={M},C={C},T={T}]",
                lambda T=T: trainer.lower_train_step(U * C, T),  # one micro-batch per update
                trips=U * M,
                model_flops=flops,
                opaque_flops=opaque,
                hardware_flops=hardware_flops(cfg, C, T, backward=True, kernel=kernel) / chips,
                weight_bytes=weights,
            )
        )
        if not t.recomputes:
            continue  # every row comes with its sampling log-probs: the trainer never recomputes
        # the behaviour recompute's program runs one chunk of C rows per call
        opaque = attention_kernel_flops(cfg, C, T, backward=False) / chips if kernel else 0.0
        programs.append(
            Program(
                f"recompute[C={C},T={T}]",
                lambda T=T: trainer.lower_recompute(batch, T),
                model_flops=train_model_flops(cfg, C, T) / 3.0 / chips,  # a forward (2 N D + attention) of C rows
                opaque_flops=opaque,
                hardware_flops=hardware_flops(cfg, C, T, backward=False, kernel=kernel) / chips,
                weight_bytes=weights,
            )
        )
    return programs


# Probe compiles (below) without XLA's windowed einsum: SPMD would otherwise build loops for
# collective matmuls (an FSDP weight gradient: one trip per shard), whose bodies XLA's cost
# analysis counts once. Their time is then XLA's estimate without collective-matmul overlap.
PROBE_OPTIONS = {
    "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False,
    "xla_tpu_enable_windowed_einsum_for_all_gather": False,
}


def compile_program(program: Program, chip: Chip | None, log=print, probes=None) -> dict:
    """One program's record. `probes`: (layers, costs) for a program whose blocks run under
    `lax.scan`, whose body XLA's cost analysis counts once; `costs()` gives XLA's (flops, bytes,
    seconds) of the program compiled with 1 and with 2 blocks unrolled (`_layer_probes`), and its cost is
    extrapolated from those: c1 + (L - 1) (c2 - c1)."""
    start = time.perf_counter()
    record = {"name": program.name}
    try:
        compiled = program.lower().compile()
        flops, accessed, seconds = _cost(compiled)
        estimate = "xla"
        if probes is not None:
            layers, costs = probes
            (f1, b1, s1), (f2, b2, s2) = costs()
            flops, accessed = f1 + (layers - 1) * (f2 - f1), b1 + (layers - 1) * (b2 - b1)
            seconds = s1 + (layers - 1) * (s2 - s1) if min(s1, s2) > 0 else -1.0
            estimate = "xla, layers extrapolated"
    except Exception as err:  # e.g. RESOURCE_EXHAUSTED where libtpu still refuses: report, go on
        record.update(error=f"{type(err).__name__}: {' '.join(str(err).split())[:600]}")
        log(f"  {program.name}: compile failed: {record['error']}")
        return record
    memory = compiled.memory_analysis()
    record.update(
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        scan_trips=program.trips,
    )
    if program.cost:
        record.update(_estimate(program, record, chip, (flops, accessed, seconds), estimate))
    else:
        record.update(flops=None, bytes_accessed=None, estimated_s=None, estimate="not estimated (blocks under scan)")
    seconds, flops = record["estimated_s"], record["flops"]
    tflop = "-" if flops is None else f"{flops / 1e12:.3f}"
    log(
        f"  {program.name}: compiled in {time.perf_counter() - start:.1f} s: temp {record['temp_bytes'] / GiB:.2f} "
        f"GiB, {tflop} TFLOP, estimated {seconds} s ({record['estimate']})"
    )
    return record


def _target_config(cfg, target: RoleTarget):
    if cfg.attention == "auto" and target.mesh.devices.flat[0].platform == "tpu":
        # "auto" reads the default backend, which is this host's CPU while compiling for TPU chips.
        cfg = cfg.replace(attention="pallas_tpu")
    return cfg


def probe_costs(
    config: RunConfig, target: RoleTarget, cfg, *, train_lengths=(), estimate_lengths=None, only=None, log=print
) -> dict:
    """XLA's [flops, bytes, seconds] of the trainer's cost probes, {program name: [1 block, 2
    blocks]}: the part of the trainer role that `compile_role(probes_from=...)` takes from another
    process (tpu_compile --jobs=2 has the rollout role's process compile them after its own)."""
    cfg = _target_config(cfg, target)
    trainer = _abstract_trainer(cfg, target.mesh, config.trainer)
    programs = trainer_programs(config, trainer, cfg, int(target.mesh.devices.size), train_lengths)
    wanted = {p.name for p in _selected(programs, only)}
    costs = {}
    for name, (_, pair) in _layer_probes(config, target, cfg, programs, train_lengths, estimate_lengths).items():
        if name not in wanted:
            continue
        start = time.perf_counter()
        costs[name] = [list(probe()) for probe in pair]
        log(f"  {name}: cost probes (1 and 2 blocks) compiled in {time.perf_counter() - start:.1f} s")
    return costs


def compile_role(
    config: RunConfig,
    target: RoleTarget,
    cfg,
    *,
    train_lengths=(),
    estimate_lengths=None,
    log=print,
    probes_from: Callable[[str], list] | None = None,
    only=None,
) -> dict:
    """One role's record. With `model.scan_layers`, the trainer programs at `estimate_lengths`
    (default: the one width nearest 4096) get cost estimates from unrolled 1- and 2-block probe
    compiles; the other scanned programs are compiled for their memory only (estimate None).
    `probes_from(name)`: those probes' costs from elsewhere (`probe_costs`, in another process;
    may wait for them), asked for after every other program has compiled. `only`: the names (before
    "[") of the programs to compile, the rest left out; the record then claims no fit (fits None),
    only a misfit (False: the programs compiled already exceed the chip, or one failed)."""
    log(f"{target.role} on {target.topology} ({target.mesh.devices.size} chips, mesh {dict(target.mesh.shape)}):")
    cfg = _target_config(cfg, target)
    chips = int(target.mesh.devices.size)
    probes = {}
    kv = {}
    if target.role == "trainer":
        trainer = _abstract_trainer(cfg, target.mesh, config.trainer)
        params = bytes_per_chip(trainer.state.params)
        versions = config.coordinator.k_max + 1 if target.store_versions_on_device else 1
        resident = {
            "params": params,
            "optimizer_state": bytes_per_chip(trainer.state) - params,
            "kl_reference": params if config.trainer.kl_coef > 0 else 0,
            # versions are published in the compute dtype (Trainer.serve_dtype)
            f"param_versions_x{versions}": bytes_per_chip(_in_dtype(trainer.state.params, cfg.dtype)) * versions,
        }
        programs = trainer_programs(config, trainer, cfg, chips, train_lengths)
        probes = {
            name: (
                layers,
                (lambda pair=pair: [probe() for probe in pair])
                if probes_from is None
                else (lambda name=name: probes_from(name)),
            )
            for name, (layers, pair) in _layer_probes(
                config, target, cfg, programs, train_lengths, estimate_lengths
            ).items()
        }
    else:
        engine_config = config.rollout.engine_config()
        hbm = target.chip.hbm_bytes if target.chip else None  # sizes a paged pool of rollout.kv_pages 0
        try:
            engine = RolloutEngine(cfg, engine_config, target.mesh, hbm_bytes=hbm)
        except KVPoolTooSmall as err:  # compile with the smallest pool: the record says it does not fit
            log(f"  {err}; compiling with a pool of one request")
            smallest = dataclasses.replace(engine_config, num_pages=engine_config.pages_per_slot + 1)
            engine = RolloutEngine(cfg, smallest, target.mesh)
        served = models.split(models.abstract_model(engine.model_config))[1]  # in the compute dtype
        resident = {
            "params": bytes_per_chip(_abstract(served, engine.param_shardings)),
            "decode_state": bytes_per_chip(engine.abstract_decode_state()),
        }
        kv = kv_capacity(config, engine)
        slots = engine.config.num_slots
        programs = [rollout_program(name, lowered, cfg, chips, slots) for name, lowered in engine.lower_programs()]
        programs += _scoring_programs(config, engine, _abstract(served, engine.param_shardings), cfg, chips)
    names = {_kind(p.name) for p in programs}
    programs = _selected(programs, only, log)
    records = {}
    # Probes from another process are waited for last: everything else compiles meanwhile.
    order = sorted(range(len(programs)), key=lambda i: probes_from is not None and programs[i].name in probes)
    for i in order:
        program = programs[i]
        scanned_only = cfg.scan_layers and target.role == "trainer" and program.name not in probes
        if scanned_only and _width(program.name) is not None:
            program = dataclasses.replace(program, cost=False)  # XLA would count one block only
        records[i] = compile_program(program, target.chip, log, probes.get(program.name))
    records = [records[i] for i in range(len(programs))]
    if kv and target.role == "rollout" and only is None:
        kv |= _kernel_reads(engine, kv, records, target.chip)
        kv["migration_rule"] = migration_rule(config, engine, records)
    record = _role_record(target, resident, records) | kv
    if only is not None:  # programs left out: their memory is unknown, so a fit is not known; a misfit is
        fits = None if record["fits"] is True else record["fits"]
        record.update(fits=fits, programs_selected=sorted(only), program_names=sorted(names))
    return record


def _selected(programs: list[Program], only, log=None) -> list[Program]:
    """The programs named in `only` (by their name before "["); all of them when `only` is None."""
    if only is None:
        return programs
    chosen = [p for p in programs if _kind(p.name) in only]
    if log is not None and len(chosen) < len(programs):
        names = sorted({_kind(p.name) for p in programs} - set(only))
        log(f"  left out (--programs={','.join(sorted(only))}): {', '.join(names)}")
    return chosen


def _scoring_programs(config: RunConfig, engine: RolloutEngine, params, cfg, chips: int) -> list[Program]:
    """Under `trainer.behaviour_logps = "rollout"`: the slice's scoring program at its largest
    bucket (the trainer's recompute chunk of rows, the whole cache's positions); none otherwise."""
    scorer = make_scorer(config.trainer, engine)
    if scorer is None:
        return []
    rows, length = scorer.shape(scorer.max_rows, config.rollout.cache_length)
    lowered = scorer.lower(params, rows, length)
    return [scoring_program(f"score[rows={rows},T={length}]", lowered, cfg, chips, rows, length)]


def migration_rule(config: RunConfig, engine: RolloutEngine, records: list[dict]) -> list[dict]:
    """The migration rule (dora_jax.rollout.migration) on compiled costs: per prefix length (a
    quarter of a prefill chunk, one chunk, the longest a re-prefill takes), moving the slot's KV
    rows at `rollout.kv_link_bytes_per_s` against re-prefilling with the prefill programs'
    estimated times; what the rule picks. A slice measures both at run time and decides on those."""
    ec, cfg = engine.config, engine.model_config
    estimates = {}
    for record in records:
        found = re.fullmatch(r"prefill\[T=(\d+)\]", record["name"])
        if found and record.get("estimated_s") is not None:
            estimates[int(found.group(1))] = record["estimated_s"]
    costs = MigrationCosts(link_bytes_per_s=config.rollout.kv_link_bytes_per_s, prefill_seconds=estimates)
    row_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
    rows = []
    longest = min(2 * ec.max_prefill_length, ec.cache_length - 1) - 1
    for tokens in sorted({ec.max_prefill_length // 4, ec.max_prefill_length, longest}):
        try:
            chunks = ec.prefill_chunks(tokens + 1)
        except ValueError:  # a re-prefill this long would overflow the cache: no choice to make
            continue
        buckets = [next(b for b in ec.prefill_buckets if b >= n) for n in chunks]
        moved = ec.rows_bucket(tokens) * row_bytes
        rows.append(
            {
                "prefix_tokens": tokens,
                "kv_bytes_moved": moved,
                "kv_s_at_link": costs.kv_s(moved),
                "reprefill_s_estimate": costs.reprefill_s(buckets),
                "rule": costs.choose(moved, buckets),
            }
        )
    return rows


def _kernel_reads(engine: RolloutEngine, kv: dict, records: list[dict], chip: Chip | None) -> dict:
    """What XLA cannot see in the paged decode step: the ragged paged attention kernel's KV reads
    per chip with every slot at the workload's mean length, and the step's estimate with them."""
    if not engine.paged_kernel:
        return {}
    per_token = engine.kv_bytes_per_page() / engine.config.page_size
    reads = per_token * kv["mean_sequence_length"] * kv["max_concurrent_sequences"]
    out = {"kernel_kv_bytes_per_step": int(reads)}
    step = next((r for r in records if r["name"] == "generate" and "error" not in r), None)
    if step is not None and step["estimated_s"] is not None and chip is not None:
        out["decode_step_estimate_s"] = step["estimated_s"] + reads / chip.hbm_bytes_per_s
        out["decode_tokens_per_s_estimate"] = kv["max_concurrent_sequences"] / out["decode_step_estimate_s"]
    return out


def kv_capacity(config: RunConfig, engine: RolloutEngine) -> dict:
    """The rollout slice's KV capacity: page size, pool tokens, cache length, and how many sequences
    of the workload's mean prompt + response length it holds at once (the paper's response-length
    shape scaled to `rollout.max_new_tokens`, prompts at `task.source.max_prompt_tokens`: the
    config has no length distribution of its own), against a dense cache of the same bytes."""
    ec = engine.config
    fields = {
        "rollout": {"max_new_tokens": config.rollout.max_new_tokens, "cache_length": ec.cache_length},
        "coordinator": {
            "group_size": config.coordinator.group_size,
            "train_batch_size": config.coordinator.train_batch_size,
        },
        "task": {"source": {"max_prompt_tokens": _max_prompt_tokens(config)}},
    }
    workload = project_workload(fields, WorkloadSpec(), 0, "the config")
    mean_length = workload.prompt_tokens + mean_response(workload)
    pool_tokens = (ec.pool_pages - 1) * ec.page_size if ec.paged else ec.num_slots * ec.cache_length
    at_mean = int(pool_tokens // mean_length)
    return {
        "kv_page_size": ec.page_size,
        "kv_pool_tokens": int(pool_tokens),
        "cache_length": ec.cache_length,
        "mean_sequence_length": round(float(mean_length), 1),
        "pool_sequences_at_mean_length": at_mean,  # what the pool holds; slots (rollout.slots) may bind first
        "max_concurrent_sequences": min(ec.num_slots, at_mean),
        "dense_concurrent_sequences_same_bytes": int(min(ec.num_slots, pool_tokens // ec.cache_length)),
    }


def _max_prompt_tokens(config: RunConfig) -> int:
    source = getattr(config.task, "source", None)
    value = getattr(source, "max_prompt_tokens", 0) if source is not None else 0
    return int(value or 0) or config.rollout.cache_length - config.rollout.max_new_tokens


def _kind(name: str) -> str:
    """The name of a program before its shape: `grad` of `grad[rows=16,T=4096]` (`--programs`)."""
    return name.split("[")[0]


def _width(name: str) -> int | None:
    """The T of a program named like `grad[rows=16,T=4096]`; None for one without rows."""
    found = re.search(r"\bT=(\d+)", name)
    return int(found.group(1)) if found else None


def _abstract_trainer(cfg: models.ModelConfig, mesh: Mesh, trainer_config) -> Trainer:
    graphdef, abstract_params = models.split(models.abstract_model(cfg))
    axes = models.logical_axes(models.abstract_model(cfg))
    return Trainer.abstract(graphdef, abstract_params, axes, mesh, trainer_config)


def _layer_probes(config: RunConfig, target: RoleTarget, cfg, programs, train_lengths, estimate_lengths) -> dict:
    """{program name: (layers, [probe with 1 block, with 2 blocks])} for the trainer's programs that
    run the blocks under `lax.scan` (model.scan_layers), at `estimate_lengths` (default: the one
    width nearest 4096); {} without scanned blocks. A probe compiles the program with its blocks
    unrolled and the vocabulary in one pass (no scan XLA would count once either) and returns XLA's
    whole (flops, bytes, seconds), and two of them give the cost of one more block."""
    if not cfg.scan_layers:
        return {}
    widths = sorted({_width(p.name) for p in programs} - {None})
    if estimate_lengths is None:  # the width nearest 4K tokens
        estimate_lengths = [min(widths, key=lambda T: abs(math.log2(T / 4096)))] if widths else []
    unknown = sorted(set(estimate_lengths) - set(widths))
    if unknown:
        raise ValueError(f"--estimate_lengths={unknown} are not widths the trainer compiles; expected some of {widths}")
    options = PROBE_OPTIONS if target.mesh.devices.flat[0].platform == "tpu" else None
    trainer_config = dataclasses.replace(config.trainer, vocab_chunk=0)
    probe_config = dataclasses.replace(config, trainer=trainer_config)
    probes: dict[str, list] = {}
    for layers in (1, 2):
        small = cfg.replace(num_layers=layers, scan_layers=False)
        trainer = _abstract_trainer(small, target.mesh, trainer_config)
        for program in trainer_programs(probe_config, trainer, small, int(target.mesh.devices.size), train_lengths):
            if _width(program.name) in estimate_lengths:
                probe = lambda lower=program.lower: _cost(lower().compile(compiler_options=options))  # noqa: E731
                probes.setdefault(program.name, []).append(probe)
    return {name: (cfg.num_layers, pair) for name, pair in probes.items()}


def _role_record(target: RoleTarget, resident: dict, records: list[dict]) -> dict:
    capacity = target.chip.hbm_bytes if target.chip else _device_limit(target.mesh)
    compiled = [r for r in records if "error" not in r]
    largest = max(compiled, key=transient_bytes, default=None)
    resident_total = sum(resident.values())
    peak = resident_total + (transient_bytes(largest) if largest else 0)
    fits = None if capacity is None else bool(peak <= capacity and len(compiled) == len(records))
    return {
        "role": target.role,
        "topology": target.topology,
        "chips": int(target.mesh.devices.size),
        "mesh": {k: int(v) for k, v in target.mesh.shape.items()},
        "hbm_capacity_bytes_per_chip": capacity,
        "resident_bytes_per_chip": resident_total,
        "resident_breakdown": resident,
        "peak_bytes_per_chip": peak,
        "largest_program": largest["name"] if largest else None,
        "fits": fits,
        "programs": records,
    }


def _device_limit(mesh: Mesh) -> int | None:
    stats = mesh.devices.flat[0].memory_stats() or {}
    return stats.get("bytes_limit")


def compile_roles(
    config: RunConfig,
    pod,
    target: str,
    *,
    train_lengths=(),
    estimate_lengths=None,
    roles=("trainer", "rollout"),
    log=None,
    on_role=None,
    probes_in: str | None = None,
    probes_out: str | None = None,
    programs=None,
):
    """compile.json's content (without "config") for `config` on `target` (see `plan_roles`).
    `on_role(partial_result)` is called after each role (big models compile for many minutes).
    Two processes can share the trainer's work: the one given `probes_out` compiles the trainer's
    cost probes after its own roles and writes their costs there (`write_probe_costs`); the one
    given `probes_in` takes them from there, waiting for the file once everything else has compiled.
    `programs`: compile only the programs of these names (before "["), e.g. ("recompute",): a quick
    look at their memory and estimates; a role is then found not to fit (False) or nothing (None)."""
    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    cfg = model_config(config)
    plans = plan_roles(config, pod, target)
    cache = jax.config.jax_enable_compilation_cache
    # A TPU executable compiled for a topology cannot be read back without a TPU client: no cache.
    jax.config.update("jax_enable_compilation_cache", target == "local" and cache)
    records = []
    costs_in = None if probes_in is None else read_probe_costs(probes_in)
    only = None if programs is None else frozenset(programs)
    try:
        for plan in [p for p in plans if p.role in roles]:
            records.append(
                compile_role(
                    config,
                    plan,
                    cfg,
                    train_lengths=train_lengths,
                    estimate_lengths=estimate_lengths,
                    log=log,
                    probes_from=costs_in,
                    only=only,
                )
            )
            if on_role is not None:
                on_role(result_of(records))
        if probes_out is not None:
            (trainer,) = [p for p in plans if p.role == "trainer"]
            costs = probe_costs(
                config,
                trainer,
                cfg,
                train_lengths=train_lengths,
                estimate_lengths=estimate_lengths,
                only=only,
                log=log,
            )
            write_probe_costs(probes_out, costs=costs)
    except BaseException as err:
        if probes_out is not None and not os.path.exists(probes_out):
            write_probe_costs(probes_out, error=f"{type(err).__name__}: {err}")
        raise
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)
    return result_of(records)


def write_probe_costs(path: str, *, costs: dict | None = None, error: str | None = None) -> None:
    """The trainer's cost probes, {"costs": {program: [[flops, bytes, s] x 2]}} or {"error": why},
    written whole (a reader never sees half a file)."""
    with open(path + ".tmp", "w") as f:
        json.dump({"costs": costs} if error is None else {"error": error}, f)
    os.replace(path + ".tmp", path)


def read_probe_costs(path: str, poll_s: float = 1.0) -> Callable[[str], list]:
    """`costs(program name)` from the file `write_probe_costs` writes, waiting for it to appear;
    RuntimeError naming the file when the other process failed or did not probe that program."""
    costs: dict = {}

    def get(name: str) -> list:
        if not costs:
            while not os.path.exists(path):
                time.sleep(poll_s)
            with open(path) as f:
                data = json.load(f)
            if "error" in data:
                raise RuntimeError(f"the trainer's cost probes failed in the other process ({path}): {data['error']}")
            costs.update(data["costs"])
        if name not in costs:
            raise RuntimeError(f"{path} holds no cost probes for {name}; it has {sorted(costs)}")
        return costs[name]

    return get
