"""The file-system seam: a run's files (its workdir, the versions root, data files) are read and
written through these functions, so that a workdir may be a local path or `gs://bucket/path`.

Local paths (and `file://` URLs) are plain files: `os` and `open()`, as before. `gs://` goes
through gcsfs (fsspec); fsspec's other URLs (`http://`, ...) can be read. GCS has no directories
and cannot append: `makedirs` checks the bucket instead, and a file opened with "a" is an
`object_log.Appender` (numbered chunk objects, composed into one object at close). Either kind
of appender has `write`, `flush(wait=True)` and `close`; `flush(wait=False)` only hands a GCS
buffer to its upload thread.

orbax (through etils.epath) and tensorstore reach gs:// by themselves; `check_access`, which
every user of a gs:// root calls first, points them the same way:
- epath goes through gcsfs (EPATH_USE_TF=false: with TensorFlow installed epath would use
  tf.io.gfile, which knows nothing of the emulator), with uncached listings, since other
  processes (and tensorstore) write the same bucket;
- with STORAGE_EMULATOR_HOST set (a local GCS emulator, as in the tests), gcsfs talks to it
  anonymously and without its gRPC bucket-type probe (an emulator serves the JSON API only), and
  tensorstore through TENSORSTORE_GCS_HTTP_URL with a fixed token (GOOGLE_AUTH_TOKEN_FOR_TESTING).
It also fails early, naming the path and how to authenticate, when there are no credentials or
no such bucket: epath's `mkdir` would otherwise create a missing bucket.
"""

from __future__ import annotations

import builtins
import io
import os
import shutil
from collections.abc import Iterator
from typing import IO

from dora_jax.core import object_log

AUTH_HINT = (
    "authenticate with `gcloud auth application-default login`, or run on a VM whose service account "
    "may read and write the bucket, or set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file"
)


class StorageError(OSError):
    """A gs:// path that cannot be used: no credentials, no bucket, no access."""


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _local(path: str) -> str:
    return path.removeprefix("file://")


def join(path: str, *names: str) -> str:
    if is_remote(path):
        return "/".join([path.rstrip("/"), *names])
    return os.path.join(path, *names)


def basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1] if is_remote(path) else os.path.basename(os.path.normpath(path))


# --------------------------------------------------------------------------- gs:// set-up
def _emulator() -> str | None:
    host = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if host in ("", "default"):
        return None
    return host if host.startswith(("http://", "https://")) else f"http://{host}"


def configure_gcs() -> None:
    """Points gcsfs, epath (orbax) and tensorstore at GCS, or at the emulator (module docstring).
    Process-wide, as their settings are; a second call changes nothing."""
    import fsspec

    if os.environ.get("EPATH_USE_TF") != "false":
        os.environ["EPATH_USE_TF"] = "false"
        try:
            from etils.epath import gpath

            gpath._is_tf_installed.cache_clear()  # epath caches its choice on first use
        except (ImportError, AttributeError):
            pass
    emulator = _emulator()
    for protocol in ("gs", "gcs"):
        options = fsspec.config.conf.setdefault(protocol, {})
        options.setdefault("use_listings_cache", False)
        if emulator:
            options["token"] = "anon"
    if emulator:
        from gcsfs.core import GCSFileSystem  # the plain one: no gRPC storage-layout calls

        for protocol in ("gs", "gcs"):
            if fsspec.get_filesystem_class(protocol) is not GCSFileSystem:
                fsspec.register_implementation(protocol, GCSFileSystem, clobber=True)
        os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", emulator)
        os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")


def _fs(path: str):
    import fsspec

    if path.startswith(("gs://", "gcs://")):
        configure_gcs()
    return fsspec.core.url_to_fs(path)[0]


def check_access(path: str) -> None:
    """For gs:// paths: credentials found and the bucket there, or a StorageError naming the path
    and saying what to do. Local paths pass."""
    if not path.startswith("gs://"):
        return
    configure_gcs()
    bucket = path.removeprefix("gs://").split("/", 1)[0]
    if not bucket:
        raise StorageError(f"{path}: no bucket in the path; expected gs://BUCKET/PATH")
    emulator = _emulator()
    if emulator is None:
        import google.auth
        import google.auth.exceptions

        try:
            google.auth.default()
        except google.auth.exceptions.DefaultCredentialsError as err:
            raise StorageError(f"{path}: no Google Cloud credentials found ({err}); {AUTH_HINT}") from None
    hint = f"is the emulator at STORAGE_EMULATOR_HOST={emulator} running?" if emulator else AUTH_HINT
    gcs = _fs(path)
    try:
        gcs.info(f"gs://{bucket}")
    except FileNotFoundError:
        raise StorageError(
            f"{path}: bucket gs://{bucket} does not exist or these credentials cannot see it: create it "
            f"(`gcloud storage buckets create gs://{bucket}`) or {AUTH_HINT}"
        ) from None
    except Exception as err:  # 401, 403, no network, no emulator
        if "Forbidden" not in str(err):
            raise StorageError(f"{path}: cannot reach gs://{bucket}: {type(err).__name__}: {err}; {hint}") from err
        try:  # reading the bucket's metadata is forbidden (an object-only role): objects are what we need
            gcs.ls(path)
        except FileNotFoundError:
            pass
        except Exception as err2:
            raise StorageError(f"{path}: no access to gs://{bucket}: {err2}; {AUTH_HINT}") from err2


# --------------------------------------------------------------------------- files and directories
def makedirs(path: str) -> None:
    """A local directory (and its parents); on GCS, which has none, the bucket's check."""
    if is_remote(path):
        check_access(path)
    else:
        os.makedirs(_local(path), exist_ok=True)


def exists(path: str) -> bool:
    if not is_remote(path):
        return os.path.exists(_local(path))
    gcs = _fs(path)
    return gcs.exists(path) or gcs.exists(object_log.chunk_dir(path))


def isdir(path: str) -> bool:
    return _fs(path).isdir(path) if is_remote(path) else os.path.isdir(_local(path))


def listdir(path: str) -> list[str]:
    """The names in a directory, sorted; a growing GCS file shows once, by its own name."""
    if not is_remote(path):
        return sorted(os.listdir(_local(path)))
    names = {entry.rstrip("/").rsplit("/", 1)[-1] for entry in _fs(path).ls(path, detail=False)}
    return sorted(n.removesuffix(".chunks") for n in names)


def size(path: str) -> int:
    if not is_remote(path):
        return os.path.getsize(_local(path))
    objects = object_log.plan(_fs(path), path)
    if objects is None:
        raise FileNotFoundError(f"{path}: no such file")
    return sum(n for _, n in objects)


def remove(path: str) -> None:
    if is_remote(path):
        object_log.remove(_fs(path), path)
    else:
        os.remove(_local(path))


def read_blocks(path: str, start: int = 0) -> Iterator[bytes]:
    """The file's bytes from `start`, a block at a time (a growing GCS file: whatever is stored)."""
    if is_remote(path):
        yield from object_log.read_blocks(_fs(path), path, start)
        return
    with builtins.open(_local(path), "rb") as f:
        f.seek(start)
        yield from iter(lambda: f.read(1 << 20), b"")


def read_bytes(path: str, start: int = 0) -> bytes:
    if not is_remote(path):
        with builtins.open(_local(path), "rb") as f:
            f.seek(start)
            return f.read()
    if path.startswith("gs://"):
        return b"".join(read_blocks(path, start))
    with _fs(path).open(path, "rb") as f:
        f.seek(start)
        return f.read()


def truncate(path: str, length: int) -> None:
    if is_remote(path):
        object_log.replace(_fs(path), path, read_bytes(path)[:length])
    else:
        os.truncate(_local(path), length)


def open(path: str, mode: str = "r", *, fsync: bool = False, atomic: bool = False) -> IO:  # noqa: A001
    """Modes "r"/"rb": the whole file; "w"/"wb": replaces it (on GCS whole, at close); "a"/"ab":
    an appender (`write`, `flush(wait=True)`, `close`; `fsync`: local flushes reach the disk).
    `atomic` ("w"/"wb"): a local file is replaced whole at close too, by a rename, so that another
    process reading it sees the old content or the new, never a part, and a write that raises
    leaves the old; without it the file is rewritten in place (an appender another part of the
    run holds open on it keeps writing to it)."""
    if mode not in ("r", "rb", "w", "wb", "a", "ab"):
        raise ValueError(f"mode {mode!r}: expected r, rb, w, wb, a or ab")
    binary = mode.endswith("b")
    if not is_remote(path):
        if mode.startswith("a"):
            return _LocalAppender(_local(path), binary=binary, fsync=fsync)
        if mode.startswith("w") and atomic:
            return _ObjectWriter(_local(path), binary=binary, store=_replace_local)
        return builtins.open(_local(path), mode, **({} if binary else {"encoding": "utf-8"}))
    if mode.startswith("r"):
        raw = io.BytesIO(read_bytes(path))
        return raw if binary else io.TextIOWrapper(raw, encoding="utf-8")
    if not path.startswith("gs://"):
        raise NotImplementedError(f"{path}: only gs:// URLs can be written")
    if mode.startswith("a"):
        return object_log.Appender(_fs(path), path)
    return _ObjectWriter(path, binary=binary)


class _LocalAppender:
    """A local file opened for appending, with the GCS appender's `flush(wait)`."""

    def __init__(self, path: str, *, binary: bool, fsync: bool):
        self.path = path
        self._file = builtins.open(path, "ab" if binary else "a", **({} if binary else {"encoding": "utf-8"}))
        self._fsync = fsync

    def write(self, data):
        return self._file.write(data)

    def flush(self, wait: bool = True) -> None:
        del wait  # a local flush is as cheap as a hand-off
        self._file.flush()
        if self._fsync:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _store_object(path: str, data: bytes) -> None:
    gcs = _fs(path)
    gcs.pipe_file(path, data)
    object_log.drop_chunks(gcs, path)  # what was appended before is replaced too


def _replace_local(path: str, data: bytes) -> None:
    """Written beside `path`, then renamed over it: another process reading it (the weights
    server's address file, rewritten at every offer) never sees it empty or cut."""
    temp = f"{path}.{os.getpid()}.tmp"
    with builtins.open(temp, "wb") as f:
        f.write(data)
    os.replace(temp, path)


class _ObjectWriter:
    """Collects a whole file and stores it at close (GCS objects are written whole; a local file
    opened with `atomic=True` is renamed over its path): a reader never sees a part, and a write
    that raises leaves the old content."""

    def __init__(self, path: str, *, binary: bool, store=None):
        self.path, self._binary, self._parts, self.closed = path, binary, [], False
        self._store = store or _store_object

    def write(self, data):
        self._parts.append(data)
        return len(data)

    def writelines(self, lines) -> None:
        self._parts.extend(lines)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        data = b"".join(self._parts) if self._binary else "".join(self._parts).encode("utf-8")
        self._store(self.path, data)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:  # a write that raised stores nothing: the old file stays
            self.closed = True


def copy_dir(source: str, target: str) -> None:
    """Copies a directory tree between local disk and GCS (either way) or within local disk."""
    if not is_remote(source) and not is_remote(target):
        shutil.copytree(_local(source), _local(target), dirs_exist_ok=True)
    elif is_remote(target):
        _fs(target).put(_local(source).rstrip("/") + "/", target.rstrip("/") + "/", recursive=True)
    else:
        os.makedirs(_local(target), exist_ok=True)
        _fs(source).get(source.rstrip("/") + "/", _local(target).rstrip("/") + "/", recursive=True)
