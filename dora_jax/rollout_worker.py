"""`python -m dora_jax.rollout_worker`: a rollout slice role process.

The command lives in dora_jax/cli/rollout_worker.py.
"""

from dora_jax.cli.rollout_worker import run

if __name__ == "__main__":
    run()
