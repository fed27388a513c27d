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
import time
import zlib
from concurrent.futures import Future

import numpy as np

from dora_jax import run_config, runner
from dora_jax.coordinator.ledger import read_ledger
from dora_jax.setup import build_setup

MODES = ("sync", "one_step_off", "partial_rollout", "dora")


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
    """Log-normal response lengths (median, sigma), capped at `max_len`. What matters is the skew
    inside one training batch: calibrate sigma so sync's bubble ratio lands in the paper's 74-88%."""

    median: float
    sigma: float
    max_len: int

    def draw(self, prompt_id: str, sample: int, seed: int) -> int:
        rng = np.random.default_rng([seed, zlib.crc32(prompt_id.encode()), sample])
        return int(np.clip(round(rng.lognormal(np.log(self.median), self.sigma)), 1, self.max_len))


class ConstantScorer:
    """Trace-driven runs measure the system, not learning: every sample scores 0."""

    def submit(self, trajectory) -> Future:
        future: Future = Future()
        future.set_result((0.0, None))
        return future


def busy_union(intervals) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted((s, e) for s, e, *_ in intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total = 0.0
    for s, e in a:
        for s2, e2 in b:
            total += max(0.0, min(e, e2) - max(s, s2))
    return total


def take_profile(events) -> dict:
    """What the version window holds each time the trainer takes a batch (means over steps): samples
    still decoding, finished samples whose group is not (a sibling still decodes: the group
    cannot be trained yet), and finished samples of complete groups. Shows whether the trainer
    waits on long-tail stragglers holding their groups back."""
    in_flight: set[str] = set()
    finished: dict[str, set[str]] = {}  # group -> finished samples not yet consumed
    members: dict[str, int] = {}  # group -> samples dispatched
    snapshots, step = [], None
    for event in events:
        kind = event.get("ev")
        if kind == "dispatch" and not event.get("redispatch"):
            in_flight.add(event["traj"])
            members[event["group"]] = members.get(event["group"], 0) + 1
        elif kind == "finish":
            in_flight.discard(event["traj"])
            finished.setdefault(event["traj"].rsplit("/", 1)[0], set()).add(event["traj"])
        elif kind == "consume":
            if event["step"] != step:
                step = event["step"]
                waiting = sum(len(done) for group, done in finished.items() if len(done) < members[group])
                complete = sum(len(done) for group, done in finished.items() if len(done) == members[group])
                snapshots.append((len(in_flight), waiting, complete))
            group = event["traj"].rsplit("/", 1)[0]
            finished.get(group, set()).discard(event["traj"])
    if not snapshots:
        return {}
    mean = np.mean(np.asarray(snapshots, np.float64), axis=0)
    return {"decoding": float(mean[0]), "finished_in_incomplete_groups": float(mean[1]),
            "finished_in_complete_groups": float(mean[2])}


def mode_result(result: runner.RunResult, config: run_config.RunConfig) -> dict:
    rollout = busy_union([i for slice_timeline in result.timelines["slices"] for i in slice_timeline])
    train = busy_union(result.timelines["trainer"])
    rollout_s = sum(e - s for s, e in rollout)
    rollout_only = rollout_s - overlap(rollout, train)
    generated = sum(r["generated_tokens"] for r in result.metrics)
    train_tokens = sum(r["loss_tokens"] for r in result.metrics)
    report = result.audit
    slot_steps, idle_slot_steps = result.timelines["slot_totals"]
    return {
        "wall_s": result.wall_s,
        "steps": result.steps,
        "train_tokens": train_tokens,
        "tokens_per_s": train_tokens / result.wall_s,
        "step_time_s": result.wall_s / result.steps,
        "rollout_only_share": rollout_only / result.wall_s,
        "rollout_only_s_per_step": rollout_only / result.steps,
        "bubble_ratio": idle_slot_steps / slot_steps if slot_steps else 0.0,
        "trainer_wait_s": result.coordinator_stats["trainer_wait_s"],
        "train_busy_s": result.train_busy_s,
        "max_staleness": report.max_staleness,
        "audit_ok": report.ok,
        "c1_violations": len(report.c1_violations),
        "migrations_kv": report.migrations_kv,
        "max_versions_in_flight": report.max_versions_in_flight,
        "generated_tokens": generated,
        "at_take": take_profile(read_ledger(os.path.join(result.workdir, "ledger.jsonl"))),
    }


def run_modes(cfg_dict, out_dir: str, modes=MODES, lengths: LengthDistribution | None = None) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    lengths = lengths or LengthDistribution(cfg_dict.bench.median_len, cfg_dict.bench.sigma, cfg_dict.bench.max_len)
    seed = int(cfg_dict.seed)
    results, timelines = {}, {}
    for mode in ("warmup",) + tuple(modes):  # the warm-up pass compiles every program first
        measure = mode != "warmup"
        mode = mode if measure else "dora"
        with cfg_dict.unlocked():
            cfg_dict.mode = mode
        config = run_config.parse(cfg_dict)
        if not measure:
            config = dataclasses.replace(config, num_steps=min(config.num_steps, 3))
        workdir = os.path.join(out_dir, mode if measure else "warmup")
        setup = build_setup(config, workdir)
        result = runner.run(config, workdir, setup=setup, scorer=ConstantScorer(), progress=False,
                            forced_length=lambda prompt_id, i: lengths.draw(prompt_id, i, seed))
        if not measure:
            continue
        results[mode] = mode_result(result, config)
        timelines[mode] = result.timelines
        print(f"{mode:16s} wall {result.wall_s:7.1f}s  tokens/s {results[mode]['tokens_per_s']:8.1f}  "
              f"bubbles {results[mode]['bubble_ratio']:.2f}  audit {'ok' if result.audit.ok else 'VIOLATIONS'}", flush=True)
    return {"modes": results, "timelines": timelines, "lengths": dataclasses.asdict(lengths)}


def ratios(modes: dict) -> dict:
    def r(a, b, key="tokens_per_s"):
        return modes[a][key] / modes[b][key] if a in modes and b in modes and modes[b][key] else None

    out = {"dora_vs_sync": r("dora", "sync"), "dora_vs_one_step_off": r("dora", "one_step_off"),
           "dora_vs_partial_rollout": r("dora", "partial_rollout")}
    if "sync" in modes and "dora" in modes and modes["dora"]["rollout_only_s_per_step"] > 0:
        out["rollout_speedup_vs_sync"] = modes["sync"]["rollout_only_s_per_step"] / modes["dora"]["rollout_only_s_per_step"]
    return out


def bound(modes: dict, slot_rate: float) -> dict:
    """Bubble-free bound for dora's work: every slot busy, nobody waiting. Roles share the same
    cores here (fake CPU devices), so rollout and train work add. Each is timed with the machine to
    itself: decode by `bench engine`, training by sync's train steps (sync's barrier keeps rollout
    idle while it trains). Dora's own train-step time would count twice the cores that its rollout
    used meanwhile; it is the fallback only when sync was not run."""
    work = modes["dora"]
    rollout_s = work["generated_tokens"] / slot_rate
    alone = modes.get("sync")
    if alone and alone["train_tokens"] and alone["train_busy_s"] > 0:
        train_s = work["train_tokens"] * alone["train_busy_s"] / alone["train_tokens"]
        train_how = "dora's train tokens at sync's train rate (trainer alone on the cores)"
    else:
        train_s = work["train_busy_s"]
        train_how = "dora's own train-busy time (no sync run to time the trainer alone; contended, so generous)"
    seconds = rollout_s + train_s
    return {"tokens_per_s": work["train_tokens"] / seconds, "rollout_s": rollout_s, "train_s": train_s,
            "how": ("dora's generated tokens / the full-occupancy decode rate of one slice measured alone "
                    f"(bench engine: all of this machine's cores on one slice), plus {train_how}; summed because "
                    "trainer and rollout slices share the same 2 CPU cores")}


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
                ax.broken_barh([(s - start, e - s)], (row, 0.8), color=cmap((version or 0) % 10), alpha=0.3 + 0.7 * active)
        trainer_row = len(tl["slices"])
        for s, e, version in tl["trainer"]:
            ax.broken_barh([(s - start, e - s)], (trainer_row, 0.8), color=cmap(version % 10))
        ax.set_yticks([i + 0.4 for i in range(trainer_row + 1)], [f"slice {i}" for i in range(trainer_row)] + ["trainer"])
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
    from dora_jax.bench_engine import EngineBenchConfig
    from dora_jax.tasks.running_sums import ALPHABET

    m, r = cfg_dict.model, cfg_dict.rollout
    return EngineBenchConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, vocab_size=len(ALPHABET) + 3,
        num_experts=m.num_experts, num_experts_per_tok=m.num_experts_per_tok,
        moe_intermediate_size=m.moe_intermediate_size, norm_topk_prob=m.norm_topk_prob, moe_dispatch=m.moe_dispatch,
        slots=r.slots, cache_length=r.cache_length, max_prefill_length=r.max_prefill_length,
        tensor_parallel=int(dict(cfg_dict.mesh.rollout).get("tensor", 1)))


def format_table(results: dict) -> str:
    keys = ("wall_s", "steps", "tokens_per_s", "step_time_s", "rollout_only_share", "bubble_ratio",
            "trainer_wait_s", "max_staleness", "audit_ok")
    lines = ["mode             " + " ".join(f"{k:>18s}" for k in keys)]
    for mode, row in results["modes"].items():
        lines.append(f"{mode:16s} " + " ".join(f"{_fmt(row[k]):>18s}" for k in keys))
    lines.append("ratios: " + json.dumps({k: _fmt(v) for k, v in results["ratios"].items()}))
    lines.append("bound:  " + json.dumps({k: _fmt(v) for k, v in results["bound"].items() if k != "how"}))
    return "\n".join(lines)


def _fmt(v):
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def main(cfg_dict, out_dir: str) -> dict:
    start = time.perf_counter()
    measured = run_modes(cfg_dict, out_dir)
    modes = measured["modes"]
    from dora_jax.bench_engine import run_engine_bench

    engine = run_engine_bench(engine_bench_config(cfg_dict), None)
    full = max(engine["decode"], key=lambda d: d["active_slots"])
    slot_rate = full["tokens_per_s"]  # one slice alone at full occupancy: what the shared cores decode
    results = {"modes": modes, "bound": bound(modes, slot_rate), "ratios": ratios(modes),
               "lengths": measured["lengths"], "engine_full_occupancy": full, "bench_wall_s": time.perf_counter() - start}
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    write_timeline(measured["timelines"], os.path.join(out_dir, "timeline.png"))
    print(format_table(results))
    return results
