"""`python -m dora_jax.sft`: the supervised cold start alone, cached in WORKDIR/sft.

The command lives in dora_jax/cli/sft.py.
"""

from dora_jax.cli.sft import __doc__, run  # noqa: F401  (--help prints __main__'s docstring: the command's)

if __name__ == "__main__":
    run()
