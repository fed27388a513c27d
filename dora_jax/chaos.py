"""`python -m dora_jax.chaos`: kill and restart a run at random points, then audit it.

The command lives in dora_jax/cli/chaos.py.
"""

from dora_jax.cli.chaos import __doc__, run  # noqa: F401  (--help prints __main__'s docstring: the command's)

if __name__ == "__main__":
    run()
