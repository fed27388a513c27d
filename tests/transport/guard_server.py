"""A coordinator service with authentication on, alone in its process (test_guard_process.py
sends it hostile messages and checks the process lives): prints its port, serves until stdin closes."""

from __future__ import annotations

import sys

import dora_jax
from dora_jax.transport import auth
from dora_jax.transport.service import CoordinatorService, Identity, make_server

SECRET = bytes(range(32))
HASH = "5afe" * 16


def main() -> None:
    service = CoordinatorService(Identity(HASH, dora_jax.__version__, 2, 4), log=lambda m: print(m, flush=True))
    server, port = make_server(service, 0, host="127.0.0.1", auth=auth.Authenticator(SECRET, 2))
    print(f"port {port}", flush=True)
    sys.stdin.read()  # until the test closes it
    server.stop(0)


if __name__ == "__main__":
    main()
