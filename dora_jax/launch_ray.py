"""`python -m dora_jax.launch_ray`: the run's roles as Ray actors on TPU slice placement groups
(a Ray cluster on TPU VMs or GKE, or a local one on CPU).

The command lives in dora_jax/cli/launch_ray.py.
"""

from dora_jax.cli.launch_ray import __doc__, run  # noqa: F401  (--help prints __main__'s docstring: the command's)

if __name__ == "__main__":
    run()
