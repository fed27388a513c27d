"""The roles of a run, each written once: the trainer (trainer.py), the coordinator
(coordinator.py) and a rollout slice (rollout.py). A role module builds its role, restores it,
checkpoints it and runs its loop; a placement wires the roles' ports and nothing else:

  embedded    every role in one process, threads and in-process ports (dora_jax.runtime.runner,
              `python -m dora_jax.train`)
  processes   each role its own process behind gRPC (dora_jax.runtime.placements, started by
              the role commands; `launch_local`, `launch/tpu.py`, `launch_ray`)

Whatever one placement writes (metrics keys, evaluation rows, ledger events, checkpoints, the
reward PNG), the others write through the same functions here (tests/test_pod_parity.py).
"""
