"""`python -m dora_jax.audit`: check a run's ledger against C1-C3 and exactly once.

The command lives in dora_jax/cli/audit.py.
"""

from dora_jax.cli.audit import __doc__, run  # noqa: F401  (--help prints __main__'s docstring: the command's)

if __name__ == "__main__":
    run()
