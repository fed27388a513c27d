"""The coordinator's counters, which the runner and the simulator report; a checkpoint keeps them,
so that a resumed run counts on from where it stopped."""

from __future__ import annotations

import dataclasses

# WORKDIR/coordinator_stats.json: the coordinator process's counters when it stops (as JSON).
STATS_FILE = "coordinator_stats.json"


@dataclasses.dataclass
class CoordinatorStats:
    dispatched: int = 0
    finished: int = 0
    consumed: int = 0
    migrations_kv: int = 0
    migrations_reprefill: int = 0  # admitted requests moved without their KV (re-prefill was cheaper)
    migrations_queued: int = 0
    interrupts: int = 0
    rebalances: int = 0
    switches: int = 0
    reward_failures: int = 0
    slice_failures: int = 0
    redispatched: int = 0
    late_finishes: int = 0  # finished on a slice already declared dead (re-dispatched meanwhile)
    # Posts of finished trajectories refused (dora_jax/coordinator/intake.py): each failed its slice.
    result_violations: int = 0
    trainer_wait_s: float = 0.0
    # Of trainer_wait_s, the seconds a whole batch was queued but C3 held the take: older samples
    # still decoding would be more than K versions stale after it (the rest is waiting for results).
    trainer_wait_c3_s: float = 0.0
    max_versions_in_flight: int = 0
    eval_dispatched: int = 0  # evaluation requests (counted apart from the training samples above)
    eval_finished: int = 0
    evals: int = 0  # evaluation rounds completed
    legacy_groups: int = 0  # groups started at an older version by legacy fill
    scored_groups: int = 0  # training groups completed (every sample scored)
    filtered_groups: int = 0  # of those, filtered by dynamic sampling (no reward variance; never trained on)
    filtered_samples: int = 0  # their samples
    committed_groups: int = 0  # groups committed to the trainer's next batch (trainer.grad_ahead)
    # Of those, groups a take left out after all: an older group that started later (legacy fill)
    # sorted ahead of them. The take stays oldest first; the trainer drops what it computed for them.
    commitments_broken: int = 0
    # Seconds the coordinator's loop spent in slices' command calls, by method (submit, load_version,
    # export, import_, ...). Each call returns once the worker has done it; meanwhile the loop applies
    # the results that arrive (coordinator.apply_results_during_calls) and holds other events.
    port_wait_s: dict[str, float] = dataclasses.field(default_factory=dict)
