"""The coordinator's settings: the mode, the version window and the batch sizes, checked once at
start against the number of rollout slices."""

from __future__ import annotations

import dataclasses

from dora_jax.core.modes import Supply, Switch, policy_for
from dora_jax.core.records import SamplingParams
from dora_jax.core.schema import setting
from dora_jax.core.window import staleness_bound


@dataclasses.dataclass(frozen=True)
class CoordinatorConfig:
    mode: str = "dora"
    k_max: int = setting("K: most versions a consumed trajectory may lag the trainer", 2)
    rollout_batch_size: int = setting("RBS: samples kept in flight in streaming modes (<= (k_max + 1) * TBS)", 32)
    train_batch_size: int = setting("TBS: samples per training step", 16)
    group_size: int = setting("G: samples per prompt", 4)
    max_new_tokens: int = 64
    sampling: SamplingParams = SamplingParams()
    stop_ids: tuple[int, ...] = ()
    seed: int = 0
    rebalance_period_s: float = setting("the orchestrator's periodic trigger, seconds", 0.5)
    # dora: new groups at an older version fill that version's idle slots while the trainer can
    # still consume them within C3 (dora_jax/coordinator/legacy_fill.py)
    legacy_fill: bool = setting(
        "dora: new groups at an older version in its idle slots while the trainer can take them", False
    )
    # Token ids a worker's result may hold are < this (dora_jax/coordinator/intake.py); 0: not
    # checked. The model's vocabulary, known once the model config is read: the runner and the
    # coordinator's main set it (it is no field of the config file).
    vocab_size: int = 0
    # DAPO's dynamic sampling (from trainer.dynamic_sampling): a group whose rewards are all equal
    # is filtered when it completes and more are drawn, so every batch holds TBS samples of groups
    # with reward variance (dora_jax/coordinator/dynamic_sampling.py)
    dynamic_sampling: bool = False
    # with dynamic_sampling: most groups filtered between two takes, in batches (TBS / G groups),
    # before the run stops as saturated (verl's DAPO recipe: max_num_gen_batches=10); 0: no limit
    max_filtered_batches_per_step: int = setting(
        "dynamic sampling: most batches filtered between two takes (0: no limit)", 10
    )
    # with dynamic_sampling: the reward a sample whose grading failed counts with (task.reward_on_error,
    # as the trainer scores it: dora_jax/tasks/reward_shaping.py); None ("mask"): it does not count
    reward_on_error: float | None = None
    # Where the trainer takes behaviour log-probs from (trainer.behaviour_logps): under "sampler" every
    # consumed row's are its trajectory's own sampling log-probs, and the ledger records so.
    behaviour_logps: str = "trainer"
    # A slice command (submit, version load, a migration's export and import) runs on a thread of its own
    # while the coordinator's loop applies the results that arrive (dora_jax/coordinator/port_calls.py);
    # False: the loop waits for it
    apply_results_during_calls: bool = setting(
        "the loop applies results while a slice runs a command (False: it waits for the command)", True
    )

    def validate(self, num_slices: int) -> None:
        """Rejects inconsistent settings, naming the field."""
        policy = policy_for(self.mode)
        if self.group_size < 1:
            raise ValueError(f"coordinator.group_size={self.group_size}; expected >= 1")
        if self.train_batch_size % self.group_size:
            raise ValueError(
                f"coordinator.train_batch_size={self.train_batch_size} is not a multiple of "
                f"coordinator.group_size={self.group_size}"
            )
        if self.rollout_batch_size % self.group_size:
            raise ValueError(
                f"coordinator.rollout_batch_size={self.rollout_batch_size} is not a multiple of "
                f"coordinator.group_size={self.group_size}"
            )
        if policy.supply == Supply.STREAM:
            if self.k_max < 1:
                raise ValueError(f"coordinator.k_max={self.k_max}; mode {self.mode} needs k_max >= 1")
            if self.rollout_batch_size < self.train_batch_size:
                raise ValueError(
                    f"coordinator.rollout_batch_size={self.rollout_batch_size} < train_batch_size="
                    f"{self.train_batch_size}; mode {self.mode} keeps at least one batch in flight"
                )
            if self.rollout_batch_size > (self.k_max + 1) * self.train_batch_size:
                raise ValueError(
                    f"coordinator.rollout_batch_size={self.rollout_batch_size} exceeds (k_max + 1) * "
                    f"train_batch_size={(self.k_max + 1) * self.train_batch_size}: the version window never lets "
                    "more samples than K + 1 steps can train on be unconsumed, so it could never be reached"
                )
        if self.vocab_size < 0:
            raise ValueError(f"coordinator vocab_size={self.vocab_size}; expected >= 0 (0: unchecked)")
        if num_slices < 1:
            raise ValueError(f"rollout.num_slices={num_slices}; expected >= 1")
        if self.max_filtered_batches_per_step < 0:
            raise ValueError(
                f"coordinator.max_filtered_batches_per_step={self.max_filtered_batches_per_step}; expected >= 0 "
                "(0: no limit)"
            )
        if self.legacy_fill and policy.switch != Switch.ORCHESTRATE:
            raise ValueError(f"coordinator.legacy_fill=True needs mode dora (the orchestrator), got mode {self.mode}")

    @property
    def window(self) -> int:
        return staleness_bound(self.mode, self.k_max)
