"""Run checkpoints: orbax CheckpointManager (async save, keep-last-N, atomic finalisation).

One checkpoint per saved step holds three items:

  trainer   params, optimizer state and update count (TrainState), restored with the trainer's
            own shardings;
  versions  the ParamStore's live window: every older version an in-flight or unconsumed
            trajectory still needs ({"v<N>": params}); the trainer's own version is `trainer`;
  meta      JSON: the coordinator's snapshot (in-flight requests with their tokens so far,
            finished-but-unconsumed groups, counters, the ledger offset), the prompt source's
            position, the prompts still referred to, and the config fingerprint.

A save that orbax did not finalise (killed mid-write) is never listed. A listed checkpoint that
fails to restore (corrupt or partial files) is renamed `<step>.corrupt` with a warning and the
previous one is used. A failing save (disk full, ...) raises `CheckpointError`; the caller keeps
running on the previous checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from dora_jax.core import fs

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    pass


@dataclasses.dataclass
class Restored:
    step: int
    trainer_state: Any
    versions: dict[int, Any]
    meta: dict


def _abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


class RunCheckpointer:
    """Saves and restores run checkpoints under `directory` (local path or gs://)."""

    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
        fs.check_access(directory)  # gs://: before orbax's mkdir, which would create a missing bucket
        self.directory = epath.Path(directory)
        self._keep = keep
        self._async = async_save
        self._manager = self._open()

    def _open(self) -> ocp.CheckpointManager:
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self._keep, create=True, cleanup_tmp_directories=True, enable_async_checkpointing=self._async
        )
        return ocp.CheckpointManager(self.directory, options=options, item_names=("trainer", "versions", "meta"))

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, trainer_state, versions: dict[int, Any], meta: dict) -> None:
        """Starts an (async) save of `step`; raises CheckpointError if it cannot start, or if the
        previous async save failed in the background."""
        try:
            self._manager.wait_until_finished()  # surfaces a background failure of the last save
            items = {"trainer": ocp.args.StandardSave(trainer_state), "meta": ocp.args.JsonSave(meta)}
            if versions:  # orbax refuses an empty item
                items["versions"] = ocp.args.StandardSave({f"v{v}": p for v, p in sorted(versions.items())})
            saved = self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as err:
            raise CheckpointError(
                f"checkpoint of step {step} in {self.directory} failed: {type(err).__name__}: {err}"
            ) from err
        if not saved:
            raise CheckpointError(f"checkpoint of step {step} in {self.directory} was not saved (step already exists?)")

    def wait(self) -> None:
        try:
            self._manager.wait_until_finished()
        except Exception as err:
            raise CheckpointError(f"checkpoint in {self.directory} failed: {type(err).__name__}: {err}") from err

    def restore_latest(self, trainer_abstract_fn, version_abstract_fn) -> Restored | None:
        """The newest checkpoint that restores, or None. `trainer_abstract_fn()` gives the
        TrainState of ShapeDtypeStructs (with shardings); `version_abstract_fn()` one version's."""
        for step in reversed(self.steps()):
            try:
                return self._restore(step, trainer_abstract_fn, version_abstract_fn)
            except Exception as err:
                log.warning(
                    "checkpoint step %d in %s does not restore (%s: %s); using the previous one",
                    step,
                    self.directory,
                    type(err).__name__,
                    err,
                )
                self._set_aside(step)
        return None

    def _restore(self, step: int, trainer_abstract_fn, version_abstract_fn) -> Restored:
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        if not isinstance(meta, dict) or "coordinator" not in meta:
            raise CheckpointError(f"step {step}: meta has no coordinator state")
        version_ids = [int(v) for v in meta["versions"]]
        items = {"trainer": ocp.args.StandardRestore(trainer_abstract_fn())}
        if version_ids:
            one = version_abstract_fn()
            items["versions"] = ocp.args.StandardRestore({f"v{v}": one for v in version_ids})
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        versions = {v: restored["versions"][f"v{v}"] for v in version_ids}
        return Restored(step, restored["trainer"], versions, meta)

    def _set_aside(self, step: int) -> None:
        path = self.directory / str(step)
        if path.exists():
            target = self.directory / f"{step}.corrupt"
            if target.exists():
                target.rmtree()
            path.rename(target)
        self._manager.close()
        self._manager = self._open()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def abstract_like(tree, shardings):
    """ShapeDtypeStructs of `tree` laid out as `shardings` (what `restore_latest` needs)."""
    return _abstract(tree, shardings)


def directory_of(workdir: str) -> str:
    return fs.join(workdir, "checkpoints")
