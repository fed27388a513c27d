"""`python -m dora_jax.tpu_compile`: ahead-of-time compile of every program for the config's TPU topologies.

The command lives in dora_jax/cli/tpu_compile.py.
"""

from dora_jax.cli.tpu_compile import __doc__, run  # noqa: F401  (--help prints __main__'s docstring: the command's)

if __name__ == "__main__":
    run()
