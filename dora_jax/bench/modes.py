"""`bench modes`: sync, one_step_off, partial_rollout and dora side by side on one trace-driven
workload, in one process (same model, devices, prompts and drawn response lengths).

Each request is forced to stop at a length drawn from a log-normal (the paper's median 2.4K /
max 30K tokens, scaled down), keyed by (prompt, sample) so every mode decodes the same work;
rewards are constant, so learning does not change the work. Writes DIR/results.json and
DIR/timeline.png and prints a table.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import numpy as np

from dora_jax import cli
from dora_jax.bench import disaggregated
from dora_jax.bench.engine import EngineBenchConfig, run_engine_bench
from dora_jax.bench.mode_row import MODES, mode_row, schedule, split_mode
from dora_jax.coordinator.ledger import read_ledger
from dora_jax.coordinator.trace import ConstantScorer, LengthDistribution
from dora_jax.runtime import run_config, runner
from dora_jax.runtime.build import build_setup
from dora_jax.runtime.cores import role_cores
from dora_jax.tasks.running_sums import ALPHABET


def mode_result(result: runner.RunResult, config: run_config.RunConfig) -> dict:
    """One mode's figures from an embedded run (every role a thread of this process)."""
    slot_steps, idle_slot_steps = result.timelines["slot_totals"]
    return mode_row(
        wall_s=result.wall_s,
        rows=result.metrics,
        rollout_intervals=[i for slice_timeline in result.timelines["slices"] for i in slice_timeline],
        train_intervals=result.timelines["trainer"],
        train_busy_s=result.train_busy_s,
        slot_steps=slot_steps,
        idle_slot_steps=idle_slot_steps,
        generated_tokens=sum(r["generated_tokens"] for r in result.metrics),
        trainer_wait_s=result.coordinator_stats["trainer_wait_s"],
        trainer_wait_c3_s=result.coordinator_stats["trainer_wait_c3_s"],
        legacy_groups=result.coordinator_stats["legacy_groups"],
        port_wait_s=result.coordinator_stats["port_wait_s"],
        report=result.audit,
        events=list(read_ledger(os.path.join(result.workdir, "ledger.jsonl"))),
    )


def run_modes(cfg_dict, out_dir: str, modes=MODES, lengths: LengthDistribution | None = None, rounds: int = 1) -> dict:
    """Runs every mode `rounds` times, the modes interleaved within each round (a shared machine's
    slow spells then hit all modes alike), after one warm-up pass that compiles every program."""
    os.makedirs(out_dir, exist_ok=True)
    lengths = lengths or LengthDistribution(cfg_dict.bench.median_len, cfg_dict.bench.sigma, cfg_dict.bench.max_len)
    seed = int(cfg_dict.seed)
    per_round, timelines = [{} for _ in range(rounds)], {}
    fields = {k for m in modes for k in split_mode(m)[1]}
    base = {k: _field(cfg_dict, k) for k in fields}  # a variant's fields, as the config sets them
    for mode, rnd, name in schedule(modes, rounds):
        base_mode, changes = split_mode(mode)
        with cfg_dict.unlocked():
            cfg_dict.mode = base_mode
            for key, value in {**base, **changes}.items():
                _set_field(cfg_dict, key, value)
        config = run_config.parse(cfg_dict)
        if rnd is None:
            config = dataclasses.replace(config, num_steps=min(config.num_steps, 3))
        workdir = os.path.join(out_dir, name)
        setup = build_setup(config, workdir)
        result = runner.run(
            config,
            workdir,
            setup=setup,
            scorer=ConstantScorer(),
            progress=False,
            forced_length=lambda prompt_id, i: lengths.draw(prompt_id, i, seed),
        )
        if rnd is None:
            continue
        row = per_round[rnd][mode] = mode_result(result, config)
        timelines[mode] = result.timelines  # the last round's
        print(
            f"round {rnd} {mode:16s} wall {result.wall_s:7.1f}s  tokens/s {row['tokens_per_s']:8.1f}  "
            f"bubbles {row['bubble_ratio']:.2f}  audit {'ok' if result.audit.ok else 'VIOLATIONS'}",
            flush=True,
        )
    return {"rounds": per_round, "timelines": timelines, "lengths": dataclasses.asdict(lengths)}


def _field(cfg_dict, key: str):
    node = cfg_dict
    for part in key.split("."):
        node = node[part]
    return node


def _set_field(cfg_dict, key: str, value) -> None:
    *path, last = key.split(".")
    _field(cfg_dict, ".".join(path))[last] = value


_WORST_OF_ROUNDS = ("max_staleness", "c1_violations", "max_versions_in_flight")


def median_of_rounds(rows: list[dict]) -> dict:
    """Field-wise median over rounds; a flag (audit ok) must hold in every round, and the staleness
    and violation counts are the worst round's."""
    out = {}
    for key, first in rows[0].items():
        values = [row.get(key) for row in rows]  # a round may lack a key of a nested dict
        if isinstance(first, bool):
            out[key] = all(values)
        elif isinstance(first, dict):
            out[key] = median_of_rounds(values)
        elif key in _WORST_OF_ROUNDS:
            out[key] = max(values)
        elif all(v == first for v in values):
            out[key] = first
        elif isinstance(first, str) or any(v is None for v in values):
            out[key] = None
        else:
            out[key] = float(np.median(values))
    return out


def ratios(modes: dict) -> dict:
    def r(a, b, key="tokens_per_s"):
        return modes[a][key] / modes[b][key] if a in modes and b in modes and modes[b][key] else None

    out = {
        "dora_vs_sync": r("dora", "sync"),
        "dora_vs_one_step_off": r("dora", "one_step_off"),
        "dora_vs_partial_rollout": r("dora", "partial_rollout"),
    }
    for name in modes:  # each variant against its own mode and against sync, side by side
        if "+" in name:
            out[f"{name}_vs_{split_mode(name)[0]}"] = r(name, split_mode(name)[0])
            out[f"{name}_vs_sync"] = r(name, "sync")
    if "sync" in modes and "dora" in modes and modes["dora"]["rollout_only_s_per_step"] > 0:
        out["rollout_speedup_vs_sync"] = (
            modes["sync"]["rollout_only_s_per_step"] / modes["dora"]["rollout_only_s_per_step"]
        )
    return out


def bound(modes: dict, slot_rate: float, disjoint: bool = False) -> dict:
    """Bubble-free bound for dora's work: every slot busy, nobody waiting. Decode is timed by
    `bench engine` (one slice at full occupancy, on the cores the rollout workers get). On shared
    cores (the embedded run: every role on every core) rollout and train work add, and training is
    timed by sync's train steps (sync's barrier keeps rollout idle while it trains; dora's own
    train time would count the cores its rollout used meanwhile, so it is the fallback only when
    sync was not run). On disjoint cores (`bench.trainer_cores`) the trainer has its cores to
    itself in every mode: dora's own train-busy time is its work (with the behaviour recompute of
    the older versions its batches hold, which sync's batches never need), and the bound is the
    larger of the two roles."""
    work = modes["dora"]
    rollout_s = work["generated_tokens"] / slot_rate
    alone = modes.get("sync")
    if disjoint:
        train_s = work["train_busy_s"]
        train_how = "dora's own train-busy time (the trainer alone on its cores)"
    elif alone and alone["train_tokens"] and alone["train_busy_s"] > 0:
        train_s = work["train_tokens"] * alone["train_busy_s"] / alone["train_tokens"]
        train_how = "dora's train tokens at sync's train rate (trainer alone on the cores)"
    else:
        train_s = work["train_busy_s"]
        train_how = "dora's own train-busy time (no sync run to time the trainer alone; contended, so generous)"
    seconds = max(rollout_s, train_s) if disjoint else rollout_s + train_s
    cores = (
        "the larger of the two, because trainer and rollout workers run on disjoint cores"
        if disjoint
        else "summed because trainer and rollout slices share the same CPU cores"
    )
    return {
        "tokens_per_s": work["train_tokens"] / seconds,
        "rollout_s": rollout_s,
        "train_s": train_s,
        "how": (
            "dora's generated tokens / the full-occupancy decode rate of one slice measured alone "
            f"(bench engine, on the rollout workers' cores), and {train_how}; {cores}"
        ),
    }


def write_timeline(timelines: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 1, figsize=(12, 2.2 * len(timelines)), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for ax, (mode, tl) in zip(axes[:, 0], timelines.items()):
        start = tl["start"]
        for row, slice_timeline in enumerate(tl["slices"]):
            for s, e, version, active in _coalesce(slice_timeline):
                ax.broken_barh(
                    [(s - start, e - s)], (row, 0.8), color=cmap((version or 0) % 10), alpha=0.3 + 0.7 * active
                )
        trainer_row = len(tl["slices"])
        for s, e, version in tl["trainer"]:
            ax.broken_barh([(s - start, e - s)], (trainer_row, 0.8), color=cmap(version % 10))
        ax.set_yticks(
            [i + 0.4 for i in range(trainer_row + 1)], [f"slice {i}" for i in range(trainer_row)] + ["trainer"]
        )
        ax.set_title(f"{mode}: colour = version, shade = slot occupancy, blank = idle", fontsize=9)
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _coalesce(timeline, gap: float = 0.02):
    """Merges consecutive decode steps of one version into bars (occupancy averaged)."""
    bars = []
    for s, e, version, active_fraction in timeline:
        if bars and bars[-1][2] == version and s - bars[-1][1] < gap:
            b = bars[-1]
            bars[-1] = (b[0], e, version, (b[3] * b[4] + active_fraction) / (b[4] + 1), b[4] + 1)
        else:
            bars.append((s, e, version, active_fraction, 1))
    return [(s, e, v, a) for s, e, v, a, _ in bars]


def engine_bench_config(cfg_dict):
    """The `bench engine` measurement for an experiment config's model and rollout slice."""
    m, r = cfg_dict.model, cfg_dict.rollout
    return EngineBenchConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        vocab_size=len(ALPHABET) + 3,
        num_experts=m.num_experts,
        num_experts_per_tok=m.num_experts_per_tok,
        moe_intermediate_size=m.moe_intermediate_size,
        norm_topk_prob=m.norm_topk_prob,
        moe_dispatch=m.moe_dispatch,
        slots=r.slots,
        cache_length=r.cache_length,
        max_prefill_length=r.max_prefill_length,
        tensor_parallel=int(dict(cfg_dict.mesh.rollout).get("tensor", 1)),
        page_size=int(r.get("page_size", 0)),
        kv_pages=int(r.get("kv_pages", 0)),
    )


def format_table(results: dict) -> str:
    keys = (
        "wall_s",
        "steps",
        "tokens_per_s",
        "step_time_s",
        "rollout_only_share",
        "bubble_ratio",
        "trainer_wait_s",
        "trainer_wait_c3_s",
        "coordinator_port_wait_s",
        "straggler_train_steps",
        "max_staleness",
        "audit_ok",
    )
    lines = ["mode             " + " ".join(f"{k:>18s}" for k in keys)]
    for mode, row in results["modes"].items():
        lines.append(f"{mode:16s} " + " ".join(f"{_fmt(row[k]):>18s}" for k in keys))
    for i, r in enumerate(results.get("rounds", [])):
        lines.append(f"round {i} ratios: " + json.dumps({k: _fmt(v) for k, v in r["ratios"].items()}))
    lines.append("ratios (median of rounds): " + json.dumps({k: _fmt(v) for k, v in results["ratios"].items()}))
    lines.append("bound:  " + json.dumps({k: _fmt(v) for k, v in results["bound"].items() if k != "how"}))
    return "\n".join(lines)


def _fmt(v):
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def main(cfg_dict, out_dir: str, config_flags: list[str] | None = None) -> dict:
    """With `bench.trainer_cores` > 0 every mode runs as role processes on disjoint cores
    (dora_jax/bench/disaggregated.py, started with `config_flags`: by default this command's own
    --config flags); with 0 in this process, every role on every core."""
    start = time.perf_counter()
    bench = cfg_dict.bench
    rounds, modes = int(bench.get("rounds", 1)), tuple(bench.get("modes", MODES))
    trainer_cores = int(bench.get("trainer_cores", 0))
    for name in modes:
        split_mode(name)  # names a mode (and variant) or says what it expected
    if "dora" not in modes:
        raise ValueError(f"bench.modes={modes}; expected some of {MODES}, dora among them (the bound is dora's)")
    engine_config = dataclasses.replace(engine_bench_config(cfg_dict), migration=False)
    if trainer_cores:
        flags = cli.config_flags(sys.argv[1:]) if config_flags is None else config_flags
        measured = disaggregated.run_modes(cfg_dict, out_dir, modes, rounds, flags)
        # The decode rate on the rollout workers' cores (JAX's CPU threads start now, pinned there).
        previous = os.sched_getaffinity(0)
        os.sched_setaffinity(0, role_cores(trainer_cores, sorted(previous))["rollout"])
        try:
            engine = run_engine_bench(engine_config, None)
        finally:
            os.sched_setaffinity(0, previous)
    else:
        measured = run_modes(cfg_dict, out_dir, modes=modes, rounds=rounds)
        engine = run_engine_bench(engine_config, None)
    full = max(engine["decode"], key=lambda d: d["active_slots"])
    slot_rate = full["tokens_per_s"]  # one slice alone at full occupancy: what the rollout cores decode
    rounds_out = []
    for per_mode in measured["rounds"]:
        b = bound(per_mode, slot_rate, disjoint=trainer_cores > 0)
        rounds_out.append(
            {
                "ratios": {
                    **ratios(per_mode),
                    "bound_vs_dora": b["tokens_per_s"] / per_mode["dora"]["tokens_per_s"]
                    if "dora" in per_mode
                    else None,
                },
                "bound": b,
                "tokens_per_s": {mode: row["tokens_per_s"] for mode, row in per_mode.items()},
            }
        )
    results = {
        "roles": f"processes, trainer on {trainer_cores} core(s), rollout on the rest" if trainer_cores else "threads",
        "modes": {mode: median_of_rounds([r[mode] for r in measured["rounds"]]) for mode in measured["rounds"][0]},
        "bound": median_of_rounds([r["bound"] for r in rounds_out]),
        "ratios": median_of_rounds([r["ratios"] for r in rounds_out]),
        "rounds": rounds_out,
        "lengths": measured["lengths"],
        "engine_full_occupancy": full,
        "bench_wall_s": time.perf_counter() - start,
    }
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    write_timeline(measured["timelines"], os.path.join(out_dir, "timeline.png"))
    print(format_table(results))
    return results
