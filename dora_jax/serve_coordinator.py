"""`python -m dora_jax.serve_coordinator`: the coordinator role process (gRPC service).

The command lives in dora_jax/cli/serve_coordinator.py.
"""

from dora_jax.cli.serve_coordinator import __doc__, run  # noqa: F401  (--help prints __main__'s docstring: the command's)

if __name__ == "__main__":
    run()
