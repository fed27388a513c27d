"""Run metrics: one JSON object per training step in `metrics.jsonl`, mirrored to TensorBoard."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping


class MetricsWriter:
    def __init__(self, workdir: str, *, tensorboard: bool = True):
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(workdir, "tb"))

    def write(self, step: int, scalars: Mapping[str, float], histograms: Mapping[str, list] | None = None) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in scalars.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in scalars.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            for key, values in (histograms or {}).items():
                if len(values):
                    self._tb.add_histogram(key, list(values), step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(workdir: str) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_reward_curve(workdir: str, filename: str = "reward_curve.png") -> str | None:
    """Writes WORKDIR/`filename`: `reward_mean` per step from metrics.jsonl, its running mean (over
    5 steps, or 1/20 of the run if longer), and the means of the first and last 3 steps in the
    title. Returns the path, or None when no step has a reward (nothing to plot)."""
    rows = [r for r in read_metrics(workdir) if r.get("reward_mean") is not None]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    rewards = [r["reward_mean"] for r in rows]
    window = max(5, len(rewards) // 20)
    smoothed = [
        sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1])
        for i in range(len(rewards))
    ]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(steps, rewards, marker=".", linewidth=1, alpha=0.6, label="reward_mean per step")
    ax.plot(steps, smoothed, linewidth=2, label=f"running mean ({window} steps)")
    ax.set_xlabel("training step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    first, last = sum(rewards[:3]) / len(rewards[:3]), sum(rewards[-3:]) / len(rewards[-3:])
    ax.set_title(f"{os.path.basename(os.path.normpath(workdir))}: first 3 steps {first:.3f}, last 3 {last:.3f}")
    fig.tight_layout()
    path = os.path.join(workdir, filename)
    fig.savefig(path)
    plt.close(fig)
    return path
