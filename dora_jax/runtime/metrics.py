"""Run metrics: one JSON object per row in `metrics.jsonl`, mirrored to TensorBoard and, optionally, to
Weights & Biases. The workdir may be on gs:// (dora_jax.core.fs): TensorBoard's event files then go
through the same seam (tensorboardX's writer factory for "gs"), W&B keeps its files locally."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import re
import threading
from collections.abc import Mapping

from dora_jax.core import fs

log = logging.getLogger(__name__)

WANDB_MODES = ("online", "offline", "disabled")


@dataclasses.dataclass(frozen=True)
class WandbSpec:
    """A Weights & Biases run to mirror the metrics into. `name` "" lets W&B pick one; `mode` "offline"
    writes the run under WORKDIR/wandb/ for a later `wandb sync`, "disabled" makes every call a no-op."""

    project: str = "dora_jax"
    name: str = ""
    tags: tuple[str, ...] = ()
    mode: str = "online"

    @classmethod
    def of(cls, spec) -> WandbSpec | None:
        """From a run's `log` group (dora_jax.runtime.run_config.LogSpec); None without W&B."""
        return cls(spec.wandb_project, spec.wandb_name, spec.wandb_tags, spec.wandb_mode) if spec.wandb else None

    def __post_init__(self):
        if self.mode not in WANDB_MODES:
            raise ValueError(f"log.wandb_mode={self.mode!r}: expected one of {', '.join(map(repr, WANDB_MODES))}")


def _import_wandb():
    try:
        import wandb
    except ImportError as e:
        raise ImportError(
            "Weights & Biases logging needs the wandb package: pip install wandb"
            ' (or the `wandb` extra: pip install -e ".[wandb]")'
        ) from e
    return wandb


class MetricsWriter:
    """Appends rows to WORKDIR/metrics.jsonl and mirrors their finite scalars to TensorBoard (WORKDIR/tb)
    and, given `wandb`, to a W&B run whose x-axis is the row's "step" (rows may arrive out of step order,
    e.g. evaluation rows after later training rows). `write` and `close` may be called from several
    threads."""

    def __init__(
        self,
        workdir: str,
        *,
        tensorboard: bool = True,
        wandb: WandbSpec | None = None,
        config: Mapping | None = None,
    ):
        self.path = fs.join(workdir, "metrics.jsonl")
        self._lock = threading.Lock()
        self._closed = False
        self._max_step: int | None = None
        self._wandb = self._run = None
        if wandb is not None:
            self._wandb = _import_wandb()
            self._run = self._wandb.init(
                project=wandb.project,
                name=wandb.name or None,
                tags=list(wandb.tags),
                mode=wandb.mode,
                dir=None if fs.is_remote(workdir) else workdir,  # W&B writes its own files locally
                config=dict(config or {}),
                # A new run even when another writer's run is still active; never touches the global
                # `wandb.run`'s lifetime: this writer only uses the run object it got here.
                reinit="create_new",
            )
            self._run.define_metric("step")
            self._run.define_metric("*", step_metric="step")
        self._file = fs.open(self.path, "a")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            if fs.is_remote(workdir):
                from tensorboardX import record_writer

                # Its own "gs" writer re-uploads the whole event file at each flush, past the seam.
                record_writer.register_writer_factory("gs", _SeamEventFiles())
            self._tb = SummaryWriter(fs.join(workdir, "tb"))

    def write(self, step: int, scalars: Mapping[str, float], histograms: Mapping[str, list] | None = None) -> None:
        plain = {k: _plain(v) for k, v in scalars.items()}
        row = {"step": step, **plain}
        finite = {k: v for k, v in plain.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        with self._lock:
            if self._closed:
                raise ValueError(f"write to a closed MetricsWriter ({self.path})")
            self._file.write(json.dumps(row) + "\n")
            self._file.flush(wait=False)  # on GCS stored by the appender's thread, not this one
            self._max_step = step if self._max_step is None else max(self._max_step, step)
            if self._tb is not None:
                for key, value in finite.items():
                    self._tb.add_scalar(key, value, step)
                for key, values in (histograms or {}).items():
                    if len(values):
                        self._tb.add_histogram(key, list(values), step)
            if self._run is not None and finite:
                # No `step=`: W&B's own step must increase, ours need not; "step" is the x-axis instead.
                self._run.log({**finite, "step": step})

    def close(self, images: Mapping[str, str] | None = None) -> None:
        """Closes the files; with W&B, first logs each existing image file in `images` (key -> PNG path)
        at the largest step written, then finishes the run. A second call does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._file.close()
                if self._tb is not None:
                    self._tb.close()
            finally:
                if self._run is not None:
                    try:
                        found = {k: p for k, p in (images or {}).items() if p and fs.exists(p)}
                        if found:
                            logged = {k: self._wandb.Image(_image(p)) for k, p in found.items()}
                            if self._max_step is not None:
                                logged["step"] = self._max_step
                            self._run.log(logged)
                    finally:
                        self._run.finish()


class _SeamEventFiles:
    """tensorboardX's writer factory for gs:// event files: appenders of dora_jax.core.fs."""

    def open(self, path: str):
        return fs.open(path, "ab")

    def directory_check(self, path: str) -> None:
        del path  # GCS has no directories


def _image(path: str):
    """What wandb.Image takes: the local path, or the PNG read from GCS."""
    if not fs.is_remote(path):
        return path
    from PIL import Image

    return Image.open(io.BytesIO(fs.read_bytes(path)))


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(workdir: str) -> list[dict]:
    with fs.open(fs.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


_PASS_AT = re.compile(r"eval/pass@(\d+)")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def plot_reward_curve(workdir: str, filename: str = "reward_curve.png") -> str | None:
    """Writes WORKDIR/`filename`: `reward_mean` per training step from metrics.jsonl, its running mean
    (over 5 steps, or 1/20 of the run if longer), and, from the evaluation rows (those with
    `eval/reward_greedy`), the held-out greedy reward and every `eval/pass@K` against step. The title
    holds the means of the first and last 3 training steps and the first and last greedy eval reward.
    Returns the path, or None when there is neither a training reward nor an eval row."""
    all_rows = read_metrics(workdir)
    rows = [r for r in all_rows if r.get("reward_mean") is not None]
    eval_rows = sorted((r for r in all_rows if r.get("eval/reward_greedy") is not None), key=lambda r: r["step"])
    if not rows and not eval_rows:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    title = [fs.basename(workdir) + ":"]
    if rows:
        steps = [r["step"] for r in rows]
        rewards = [r["reward_mean"] for r in rows]
        window = max(5, len(rewards) // 20)
        smoothed = [_mean(rewards[max(0, i - window + 1) : i + 1]) for i in range(len(rewards))]
        ax.plot(steps, rewards, marker=".", linewidth=1, alpha=0.6, label="reward_mean per step")
        ax.plot(steps, smoothed, linewidth=2, label=f"running mean ({window} steps)")
        title.append(f"first 3 steps {_mean(rewards[:3]):.3f}, last 3 {_mean(rewards[-3:]):.3f}")
    if eval_rows:
        greedy = [r["eval/reward_greedy"] for r in eval_rows]
        eval_steps = [r["step"] for r in eval_rows]
        ax.plot(eval_steps, greedy, marker="o", linewidth=1.5, label="eval greedy reward (held-out)")
        ks = sorted({int(m.group(1)) for r in eval_rows for key in r if (m := _PASS_AT.fullmatch(key))})
        for k in ks:
            points = [(r["step"], r[f"eval/pass@{k}"]) for r in eval_rows if r.get(f"eval/pass@{k}") is not None]
            if points:
                ax.plot(*zip(*points), marker="s", linewidth=1, linestyle="--", label=f"eval pass@{k}")
        title.append(f"eval greedy {greedy[0]:.3f} -> {greedy[-1]:.3f}")
    ax.set_xlabel("training step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(" ".join(title[:2]) + "".join(", " + t for t in title[2:]), fontsize=9)
    fig.tight_layout()
    path = fs.join(workdir, filename)
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    with fs.open(path, "wb") as f:
        f.write(png.getvalue())
    return path


def draw_reward_curve(workdir: str) -> str | None:
    """Draws WORKDIR/reward_curve.png (training reward and evaluation curves) for the trackers and
    the caller; None when there is nothing to draw or drawing failed."""
    try:
        return plot_reward_curve(workdir)
    except Exception as err:  # a plot is never worth the run's results
        log.warning("reward curve not drawn: %s", err)
        return None
