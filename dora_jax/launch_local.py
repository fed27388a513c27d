"""`python -m dora_jax.launch_local`: the multi-process run on one machine: coordinator,
trainer and rollout slices over gRPC.

The command lives in dora_jax/cli/launch_local.py.
"""

from dora_jax.cli.launch_local import run

if __name__ == "__main__":
    run()
