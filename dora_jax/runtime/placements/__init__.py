"""Placements: where each role of dora_jax.runtime.roles runs and how its ports are wired; a
placement never decides what a role does.

  embedded             dora_jax.runtime.runner: every role in one process, threads, in-process ports
  trainer_process      the trainer role in its own process (host 0 a client of the coordinator's
                       gRPC service; other hosts follow it over a JAX collective)
  coordinator_process  the coordinator role behind the gRPC service
  rollout_process      a rollout slice behind a RolloutAgent (host 0) or following host 0

The `python -m dora_jax.<role>` commands (dora_jax/cli) parse flags into a placement's `Context`
and call it; `launch_local`, `launch/tpu.py` and `launch_ray` start those commands.
"""
