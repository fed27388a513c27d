"""A local Google Cloud Storage for the gs:// tests: `gcp-storage-emulator` (the test extra) in a
subprocess on a free port, in memory, with one bucket.

While it runs, STORAGE_EMULATOR_HOST points this process and its children at it; that is all
dora_jax.core.fs needs (it then uses anonymous credentials and points tensorstore there too).

The subprocess runs this file (`__main__` below), which adds what gcp-storage-emulator 2026.7.19
leaves out and real GCS sends: the `x-goog-generation` header of a download. tensorstore takes an
object's generation from it, and its OCDBT driver (orbax checkpoints of more than one array)
rewrites its manifest on the condition `ifGenerationMatch=<that generation>`; without the header
the second write fails with "Malformed StorageGeneration".
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator


@dataclasses.dataclass(frozen=True)
class Emulator:
    url: str  # http://127.0.0.1:PORT
    bucket: str  # created at start


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(bucket: str = "bucket", start_timeout_s: float = 60.0) -> Iterator[Emulator]:
    """Starts the emulator, sets STORAGE_EMULATOR_HOST, and on exit stops it and restores the
    environment (dora_jax.core.fs adds tensorstore's settings to it)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, __file__, "start", "--host=127.0.0.1", f"--port={port}"]
    command += ["--in-memory", f"--default-bucket={bucket}", "--quiet"]
    # Its request threads print a traceback for every client that hangs up early: kept out of the test output.
    log = tempfile.TemporaryFile()
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    saved = dict(os.environ)
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                with urllib.request.urlopen(url + "/", timeout=1) as reply:
                    if reply.read() == b"OK":
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"the GCS emulator did not start on {url}:\n{log.read().decode()[-2000:]}")
            time.sleep(0.1)
        os.environ["STORAGE_EMULATOR_HOST"] = url
        yield Emulator(url, bucket)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _serve() -> None:
    """The emulator's own command line, its downloads sending their generation as GCS does."""
    from gcp_storage_emulator import server
    from gcp_storage_emulator.__main__ import main
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    plain = objects.download

    def download(request, response, storage, *args, **kwargs):
        try:
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
            response["x-goog-generation"] = str(obj["generation"])
            response["x-goog-metageneration"] = str(obj.get("metageneration", 1))
        except NotFound:
            pass  # the download answers 404 itself
        return plain(request, response, storage, *args, **kwargs)

    objects.download = download  # what objects.get calls for ?alt=media
    for _, methods in server.HANDLERS:  # the routes that name it directly
        for method, handler in list(methods.items()):
            if handler is plain:
                methods[method] = download
    main(sys.argv[1:])


if __name__ == "__main__":
    _serve()
