"""`python -m dora_jax.serve_coordinator`: the coordinator role process (gRPC service).

The command lives in dora_jax/cli/serve_coordinator.py.
"""

from dora_jax.cli.serve_coordinator import run

if __name__ == "__main__":
    run()
