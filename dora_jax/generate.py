"""`python -m dora_jax.generate`: sample from a HF checkpoint with the rollout engine.

The command lives in dora_jax/cli/generate.py.
"""

from dora_jax.cli.generate import run

if __name__ == "__main__":
    run()
