"""`python -m dora_jax.sft`: the supervised cold start alone, cached in WORKDIR/sft.

The command lives in dora_jax/cli/sft.py.
"""

from dora_jax.cli.sft import run

if __name__ == "__main__":
    run()
