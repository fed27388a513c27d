"""`python -m dora_jax.trainer_worker`: the trainer role process.

The command lives in dora_jax/cli/trainer_worker.py.
"""

from dora_jax.cli.trainer_worker import run

if __name__ == "__main__":
    run()
