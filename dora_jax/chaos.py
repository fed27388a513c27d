"""`python -m dora_jax.chaos`: kill and restart a run at random points, then audit it.

The command lives in dora_jax/cli/chaos.py.
"""

from dora_jax.cli.chaos import run

if __name__ == "__main__":
    run()
