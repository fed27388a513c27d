"""Fault injection for the reliability tests and `python -m dora_jax.chaos`.

Set `DORA_FAULTS` to a comma-separated list (parsed once per process); with it unset nothing
here does anything:

  kill=<point>:<n>          SIGKILL this process the n-th time it reaches <point>
                            (points: rollout, train_step, checkpoint_save)
  slice_error=<slice>:<step> after training step <step>, rollout slice <slice> raises
  slice_hang=<slice>:<step>  after training step <step>, rollout slice <slice> stops responding
  slice_load_error=<slice>:<step>
                            after training step <step>, rollout slice <slice>'s next read of a
                            version from the store fails (the coordinator drops the slice)
  score_error=<slice>:<step> after training step <step>, rollout slice <slice>'s scoring of its
                            finished trajectories (trainer.behaviour_logps = "rollout") fails from
                            then on: they are posted unscored, and the trainer recomputes them
  checkpoint_error=<n>      the n-th checkpoint save fails as a full disk would (ENOSPC)
  slice_kill_file=<path>    a rollout worker SIGKILLs itself at its first step with requests in
                            its slots after <path> appears, and removes <path> (launch_local
                            --kill_slice: the slice dies holding work nobody has seen finish)

The faults are real: a real SIGKILL, a real exception on the worker thread, a real OSError in the
save path; only the moment is chosen.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import signal

_hits: collections.Counter[str] = collections.Counter()
_parsed: dict | None = None
POINTS = ("rollout", "train_step", "checkpoint_save")


def parse(spec: str) -> dict:
    """'kill=train_step:3,slice_error=1:2' -> {'kill': ('train_step', 3), 'slice_error': [(1, 2)], ...}."""
    out: dict = {
        "kill": None,
        "slice_error": [],
        "slice_hang": [],
        "slice_load_error": [],
        "score_error": [],
        "checkpoint_error": None,
        "slice_kill_file": None,
    }
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, value = item.partition("=")
        try:
            if name == "kill":
                point, count = value.split(":")
                if point not in POINTS:
                    raise ValueError(f"unknown point {point!r}; expected one of {POINTS}")
                out["kill"] = (point, int(count))
            elif name in ("slice_error", "slice_hang", "slice_load_error", "score_error"):
                slice_id, step = value.split(":")
                out[name].append((int(slice_id), int(step)))
            elif name == "checkpoint_error":
                out["checkpoint_error"] = int(value)
            elif name == "slice_kill_file":
                if not value:
                    raise ValueError("expected a file path")
                out["slice_kill_file"] = value
            else:
                raise ValueError(f"unknown fault {name!r}")
        except ValueError as err:
            raise ValueError(f"DORA_FAULTS item {item!r}: {err}; see dora_jax/runtime/faults.py") from None
    return out


def reset() -> None:
    """Forgets the parsed spec and the counts: the next call re-reads DORA_FAULTS (tests)."""
    global _parsed
    _parsed = None
    _hits.clear()


def _faults() -> dict:
    global _parsed
    if _parsed is None:
        _parsed = parse(os.environ.get("DORA_FAULTS", ""))
    return _parsed


def reached(point: str) -> None:
    """Counts a pass through `point`; SIGKILLs the process on the configured pass."""
    kill = _faults()["kill"]
    if kill is None or kill[0] != point:
        return
    _hits[point] += 1
    if _hits[point] == kill[1]:
        os.kill(os.getpid(), signal.SIGKILL)


def before_rollout_step(active: int) -> None:
    """A rollout worker about to step with `active` requests in its slots: SIGKILLs the process
    when `slice_kill_file` is set, exists and some request is active (removing the file first, so
    the kill happens once). Active requests are neither finished nor exported, so the coordinator
    holds them as the slice's for certain: they are lost with it and dispatched again."""
    path = _faults()["slice_kill_file"]
    if path is None or active == 0 or not os.path.exists(path):
        return
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
    os.kill(os.getpid(), signal.SIGKILL)


def slices_to_fail(step: int) -> list[tuple[int, str]]:
    """(slice, 'error' | 'hang' | 'load_error' | 'score_error') faults due after training step `step`."""
    f = _faults()
    kinds = (
        ("slice_error", "error"),
        ("slice_hang", "hang"),
        ("slice_load_error", "load_error"),
        ("score_error", "score_error"),
    )
    return [(s, kind) for name, kind in kinds for s, at in f[name] if at == step]


def before_checkpoint_save() -> None:
    n = _faults()["checkpoint_error"]
    if n is None:
        return
    _hits["checkpoint_error"] += 1
    if _hits["checkpoint_error"] == n:
        raise OSError(errno.ENOSPC, "No space left on device (injected by DORA_FAULTS)")
