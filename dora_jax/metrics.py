"""Run metrics: one JSON object per training step in `metrics.jsonl`, mirrored to TensorBoard."""

from __future__ import annotations

import json
import math
import os
from typing import Mapping


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
