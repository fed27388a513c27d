"""`bench convergence`: the smoke learning task under sync and dora (K=1 and K=3) for the same
number of steps from the same cold-start checkpoint, judged on held-out prompts.

Each run evaluates the newest version every `eval.every_steps` steps and at the last step
(dora_jax.runtime.evaluator): greedy reward and pass@k on the same held-out prompts, against
training steps and against the wall time at which that version was published. The training
batch's reward is kept for reference only: it is not the same measure across modes (dora takes
the oldest complete groups first, short responses first within a version, so its batches are
another mix than sync's). Numbers in DIR/convergence.json, curves in DIR/convergence.png.
"""

from __future__ import annotations

import dataclasses
import json
import os

from dora_jax.runtime import run_config, runner
from dora_jax.runtime.build import build_setup

RUNS = (("sync", "sync", 1), ("dora_k1", "dora", 1), ("dora_k3", "dora", 3))


def main(cfg_dict, out_dir: str) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    curves = {}
    base = run_config.parse(cfg_dict)
    if not base.eval.enabled:
        raise ValueError("bench convergence compares the modes on held-out prompts: set eval.every_steps > 0")
    build_setup(base, out_dir)  # the shared cold start, cached in out_dir/sft
    checkpoint = os.path.join(out_dir, "sft")
    for name, mode, k_max in RUNS:
        with cfg_dict.unlocked():
            cfg_dict.mode = mode
            cfg_dict.coordinator.k_max = k_max
            cfg_dict.coordinator.rollout_batch_size = min(
                cfg_dict.coordinator.rollout_batch_size, (k_max + 1) * cfg_dict.coordinator.train_batch_size
            )
            cfg_dict.init.checkpoint = checkpoint
        config = run_config.parse(cfg_dict)
        result = runner.run(config, os.path.join(out_dir, name), progress=False)
        curves[name] = curve(result, config.eval.samples)
        c = curves[name]
        print(
            f"{name:8s} eval greedy {c['eval_greedy'][0]:.3f} -> {c['eval_greedy'][-1]:.3f}, "
            f"pass@{config.eval.samples} {c['eval_pass'][-1]:.3f}, wall {result.wall_s:.0f}s",
            flush=True,
        )
    summary = {name: summarize(c, curves["sync"]) for name, c in curves.items()}
    results = {"seed": base.seed, "eval": dataclasses.asdict(base.eval), "curves": curves, "summary": summary}
    with open(os.path.join(out_dir, "convergence.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(curves, os.path.join(out_dir, "convergence.png"), base.eval.samples)
    print(json.dumps(summary, indent=1))
    return results


def curve(result: runner.RunResult, samples: int) -> dict:
    """Evaluation by version, with the wall time of that version's publish (0 for version 0)."""
    published = {step + 1: row["wall_s"] for step, row in enumerate(result.metrics)}  # a fresh run: rows from step 0
    evals = sorted(result.evals, key=lambda r: r["step"])
    return {
        "eval_step": [r["step"] for r in evals],
        "eval_wall_s": [published.get(r["step"], 0.0) for r in evals],
        "eval_greedy": [r["eval/reward_greedy"] for r in evals],
        "eval_pass": [r.get(f"eval/pass@{samples}") for r in evals],
        "batch_reward": [r["reward_mean"] for r in result.metrics],
        "wall_s": result.wall_s,
        "audit_ok": result.audit.ok,
        "max_staleness": result.audit.max_staleness,
    }


def summarize(c: dict, sync: dict) -> dict:
    target = sync["eval_greedy"][-1]
    reached = [w for w, g in zip(c["eval_wall_s"], c["eval_greedy"]) if g >= target]
    return {
        "eval_greedy_first": c["eval_greedy"][0],
        "eval_greedy_final": c["eval_greedy"][-1],
        "eval_greedy_final_minus_sync": c["eval_greedy"][-1] - target,
        "eval_pass_final": c["eval_pass"][-1],
        "wall_s": c["wall_s"],
        "wall_s_to_sync_final_eval": reached[0] if reached else None,
        "audit_ok": c["audit_ok"],
        "max_staleness": c["max_staleness"],
    }


def plot(curves: dict, path: str, samples: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    by_step, by_time, batch = axes
    for name, c in curves.items():
        (line,) = by_step.plot(c["eval_step"], c["eval_greedy"], marker="o", label=f"{name} greedy")
        by_step.plot(
            c["eval_step"], c["eval_pass"], marker=".", ls="--", color=line.get_color(), label=f"{name} pass@{samples}"
        )
        by_time.plot(c["eval_wall_s"], c["eval_greedy"], marker="o", color=line.get_color(), label=name)
        batch.plot(range(len(c["batch_reward"])), c["batch_reward"], color=line.get_color(), alpha=0.7, label=name)
    by_step.set(xlabel="training step", ylabel="held-out reward", title="evaluation against steps")
    by_time.set(xlabel="wall time of the version's publish (s)", ylabel="held-out greedy reward", title="against time")
    batch.set(xlabel="training step", ylabel="training batch reward", title="training batch (not comparable)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
