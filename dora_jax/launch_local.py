"""`python -m dora_jax.launch_local`: the multi-process run on one machine: coordinator,
trainer and rollout slices over gRPC.

The command lives in dora_jax/cli/launch_local.py.
"""

from dora_jax.cli.launch_local import __doc__, run  # noqa: F401  (--help prints __main__'s docstring: the command's)

if __name__ == "__main__":
    run()
