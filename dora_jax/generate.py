"""`python -m dora_jax.generate`: sample from a HF checkpoint with the rollout engine.

The command lives in dora_jax/cli/generate.py.
"""

from dora_jax.cli.generate import __doc__, run  # noqa: F401  (--help prints __main__'s docstring: the command's)

if __name__ == "__main__":
    run()
