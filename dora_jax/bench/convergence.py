"""`bench convergence`: the smoke learning task under sync and dora (K=1 and K=3) for the same
number of steps from the same cold-start checkpoint; reward vs step and vs wall time in one PNG,
the numbers in DIR/convergence.json."""

from __future__ import annotations

import json
import os

from dora_jax.runtime import run_config, runner
from dora_jax.runtime.build import build_setup

RUNS = (("sync", "sync", 1), ("dora_k1", "dora", 1), ("dora_k3", "dora", 3))


def main(cfg_dict, out_dir: str) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    curves = {}
    base = run_config.parse(cfg_dict)
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
        curves[name] = {
            "reward": [r["reward_mean"] for r in result.metrics],
            "wall_s": [r["wall_s"] for r in result.metrics],
            "audit_ok": result.audit.ok,
            "max_staleness": result.audit.max_staleness,
        }
        print(f"{name:8s} final reward {_tail(curves[name]['reward']):.3f} wall {result.wall_s:.0f}s", flush=True)
    summary = {
        name: {
            "final_reward_last3": _tail(c["reward"]),
            "wall_s": c["wall_s"][-1],
            "wall_s_to_sync_final": _time_to(c, _tail(curves["sync"]["reward"])),
        }
        for name, c in curves.items()
    }
    results = {"curves": curves, "summary": summary}
    with open(os.path.join(out_dir, "convergence.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(curves, os.path.join(out_dir, "convergence.png"))
    print(json.dumps(summary, indent=1))
    return results


def _tail(values, n: int = 3) -> float:
    values = [v for v in values[-n:] if v == v]
    return sum(values) / max(len(values), 1)


def _time_to(curve: dict, target: float) -> float | None:
    """First wall time at which the 3-step moving average reaches `target`."""
    rewards = curve["reward"]
    for i in range(len(rewards)):
        if _tail(rewards[: i + 1]) >= target:
            return curve["wall_s"][i]
    return None


def plot(curves: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for name, c in curves.items():
        by_step.plot(range(1, len(c["reward"]) + 1), c["reward"], label=name)
        by_time.plot(c["wall_s"], c["reward"], label=name)
    by_step.set_xlabel("training step")
    by_time.set_xlabel("wall time (s)")
    for ax in (by_step, by_time):
        ax.set_ylabel("mean reward of the batch")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
