"""`python -m dora_jax.train`: the embedded run: every role in one process (configs/smoke.py is the smoke job).

The command lives in dora_jax/cli/train.py.
"""

from dora_jax.cli.train import __doc__, run  # noqa: F401  (--help prints __main__'s docstring: the command's)

if __name__ == "__main__":
    run()
