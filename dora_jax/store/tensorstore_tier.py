"""The tensorstore tier: one orbax checkpoint (zarr3 + OCDBT) per version under a root directory.

Layout: `<root>/v_00000042/` per version. Orbax commits atomically: on a local filesystem it
writes `<name>.orbax-checkpoint-tmp-<ts>` and renames it when complete; on `gs://` it writes a
`commit_success.txt` last. Only committed directories are listed, so a reader (in this process or
another one that opens the same root) never sees half a version, and a writer killed mid-write
leaves only a temporary directory that the next writer removes. Reads restore straight into the
reader's shardings (each process reads only the shards it holds).

`background_writes=True` takes the write off the writer's critical path (orbax's asynchronous
checkpointer: `write` returns once the arrays are copied out, the files are written and committed
in a background thread, every host of a multi-host writer in step). One write is in flight at a
time: the next `write` waits for the previous one (memory stays bounded when storage is slower
than training). Readers in other processes see a version once it is committed, as before; the
writer's own `versions()` also lists the one in flight (`pending_versions()`), and its `read` or
`delete` of that one waits for the commit. `flush()` waits for the write in flight; a failed
background write is raised by the next `write` or `flush`, naming the version.
"""

from __future__ import annotations

import re
import threading
import uuid

import jax
import orbax.checkpoint as ocp
from etils import epath

from dora_jax.core import fs
from dora_jax.store.param_store import Params, Shardings

_NAME = re.compile(r"^v_(\d+)$")


def version_dir_name(version: int) -> str:
    return f"v_{version:08d}"


class TierWriteError(OSError):
    """A version the tier failed to write (raised by the next `write` or `flush`)."""


class TensorStoreTier:
    """Versions as orbax/tensorstore checkpoints under `root` (a local path or `gs://...`).

    `read_only=True` opens an existing root for reading from another process: it lists what is
    committed there (`versions()` rescans the directory) and refuses to write or delete.
    """

    def __init__(
        self,
        root: str | epath.PathLike,
        *,
        read_only: bool = False,
        compression: bool = True,
        background_writes: bool = False,
    ):
        # gs://: credentials and bucket checked (and epath/tensorstore pointed at GCS or its emulator)
        # before epath's mkdir, which would create a missing bucket.
        fs.check_access(str(root))
        self._root = epath.Path(root)
        self._read_only = read_only
        self._compression = compression
        self._lock = threading.Lock()  # guards the version cache; I/O happens outside it
        self._cache: dict[int, epath.Path] = {}
        self._bytes: dict[int, int] = {}
        self._background: ocp.AsyncCheckpointer | None = None
        if background_writes and not read_only:
            handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True, use_compression=compression)
            self._background = ocp.AsyncCheckpointer(handler)
        self._pending: list[tuple[int, epath.Path]] = []  # written in the background, not yet seen committed
        self._settle_lock = threading.Lock()  # one waiter on the background write at a time
        if read_only:
            if not self._root.exists():
                raise FileNotFoundError(f"param store root {self._root} does not exist")
        else:
            self._root.mkdir(parents=True, exist_ok=True)
            self._remove_uncommitted()
        self._scan()

    @property
    def root(self) -> epath.Path:
        return self._root

    # ------------------------------------------------------------------ Tier
    def write(self, version: int, params: Params) -> None:
        if self._read_only:
            raise PermissionError(f"param store at {self._root} was opened read-only")
        path = self._root / version_dir_name(version)
        if self._background is None:
            self._checkpointer().save(path, args=ocp.args.PyTreeSave(params))
            self._register(version, path)
            return
        self.flush()  # the previous version committed (or its failure raised), before this one starts
        with self._lock:
            self._pending.append((version, path))
        try:
            self._background.save(path, args=ocp.args.PyTreeSave(params))
        except BaseException:
            with self._lock:
                self._pending.remove((version, path))
            raise

    def pending_versions(self) -> tuple[int, ...]:
        """Versions this process is writing in the background, not yet known to be committed."""
        with self._lock:
            return tuple(v for v, _ in self._pending)

    def flush(self) -> None:
        """Waits for the background write in flight (if any) and lists it as committed; raises
        `TierWriteError` naming the version if it failed."""
        if self._background is None:
            return
        with self._settle_lock:
            with self._lock:
                waiting = list(self._pending)
            try:
                self._background.wait_until_finished()
            except Exception as err:
                with self._lock:
                    self._pending = [p for p in self._pending if p not in waiting]
                lost = ", ".join(str(v) for v, _ in waiting)
                raise TierWriteError(
                    f"param store at {self._root}: the background write of version {lost} failed "
                    f"({type(err).__name__}: {err})"
                ) from err
            for version, path in waiting:
                self._register(version, path)
            with self._lock:
                self._pending = [p for p in self._pending if p not in waiting]

    def read(self, version: int, shardings: Shardings, *, copy: bool = True) -> Params:
        del copy  # a restore always makes fresh arrays
        if version in self.pending_versions():
            self.flush()
        path = self._path(version)
        # `item` gives the tree structure (dict keys such as layer indices stay ints); shapes
        # and dtypes come from the checkpoint's metadata, placement from the shardings.
        restore_args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s), shardings)
        args = ocp.args.PyTreeRestore(item=shardings, restore_args=restore_args)
        return self._checkpointer().restore(path, args=args)

    def delete(self, version: int) -> None:
        if self._read_only:
            raise PermissionError(f"param store at {self._root} was opened read-only")
        if version in self.pending_versions():
            self.flush()
        with self._lock:
            path = self._cache.pop(version, None)
            self._bytes.pop(version, None)
        if path is None:
            return
        if path.as_posix().startswith("gs://"):
            # Drop the commit marker first, so no reader lists it while the rest goes.
            (path / "commit_success.txt").unlink(missing_ok=True)
            path.rmtree()
            return
        # Local: a rename is atomic, so readers see the version either whole or gone.
        doomed = self._root / f".retired-{path.name}-{uuid.uuid4().hex[:8]}"
        path.rename(doomed)
        doomed.rmtree(missing_ok=True)

    def versions(self) -> tuple[int, ...]:
        if self._read_only:
            self._scan()
        with self._lock:
            return tuple(sorted(self._cache.keys() | {v for v, _ in self._pending}))

    def bytes_by_tier(self) -> dict[str, int]:
        with self._lock:
            return {"tensorstore": sum(self._bytes.values())}

    # -------------------------------------------------------------- internals
    def _register(self, version: int, path: epath.Path) -> None:
        size = _dir_bytes(path)
        with self._lock:
            self._cache[version] = path
            self._bytes[version] = size

    def _checkpointer(self) -> ocp.Checkpointer:
        # One per call: orbax checkpointers are cheap and not documented as thread-safe.
        handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True, use_compression=self._compression)
        return ocp.Checkpointer(handler)

    def _path(self, version: int) -> epath.Path:
        with self._lock:
            path = self._cache.get(version)
        if path is None:
            raise KeyError(f"no committed version {version} under {self._root}")
        return path

    def _scan(self) -> None:
        found: dict[int, epath.Path] = {}
        sizes: dict[int, int] = {}
        with self._lock:
            known = set(self._cache)
        for child in self._children():
            match = _NAME.match(child.name)
            try:
                if not (match and ocp.utils.is_checkpoint_finalized(child)):
                    continue
                version = int(match.group(1))
                if version not in known:
                    sizes[version] = _dir_bytes(child)
            except FileNotFoundError:  # the writer retired it while we looked: it is gone
                continue
            found[version] = child
        with self._lock:
            for version in found.keys() - self._cache.keys():
                self._bytes[version] = sizes.get(version, 0)  # 0: a concurrent scan dropped it meanwhile
            for version in self._cache.keys() - found.keys():
                self._bytes.pop(version, None)
            self._cache = found

    def _children(self) -> list[epath.Path]:
        """The root's entries; none for a gs:// root that holds nothing yet (GCS has no empty directories)."""
        try:
            return list(self._root.iterdir())
        except FileNotFoundError:
            return []

    def _remove_uncommitted(self) -> None:
        """A writer opening the root removes what an earlier writer left half-done."""
        for child in self._children():
            leftover = child.name.startswith(".retired-") or ocp.path.atomicity_types.TMP_DIR_SUFFIX in child.name
            if _NAME.match(child.name) and not ocp.utils.is_checkpoint_finalized(child):
                leftover = True  # gs://: a directory without its commit marker
            if leftover:
                child.rmtree(missing_ok=True)


def _dir_bytes(path: epath.Path) -> int:
    total = 0
    for child in path.iterdir():
        total += _dir_bytes(child) if child.is_dir() else child.stat().length
    return total
