"""`python -m dora_jax.trainer_worker`: the trainer role process.

The command lives in dora_jax/cli/trainer_worker.py.
"""

from dora_jax.cli.trainer_worker import __doc__, run  # noqa: F401  (--help prints __main__'s docstring: the command's)

if __name__ == "__main__":
    run()
