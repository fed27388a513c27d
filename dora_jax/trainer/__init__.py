"""GRPO/DAPO losses, advantages, the pjit-sharded train step and per-version log-prob recompute."""

from dora_jax.trainer.advantages import ESTIMATORS, group_advantages, informative_samples
from dora_jax.trainer.batching import bucket_length, make_train_batch
from dora_jax.trainer.loss import (
    LOSS_NORMS,
    LossConfig,
    LossStats,
    hidden_token_logps,
    policy_loss,
    token_logps,
    token_weights,
)
from dora_jax.trainer.step import OptimizerConfig, StepInputs, TrainState, make_optimizer, make_schedule, train_step
from dora_jax.trainer.trainer import StepMetrics, Trainer, TrainerConfig

__all__ = [
    "ESTIMATORS",
    "LOSS_NORMS",
    "LossConfig",
    "LossStats",
    "OptimizerConfig",
    "StepInputs",
    "StepMetrics",
    "TrainState",
    "Trainer",
    "TrainerConfig",
    "bucket_length",
    "group_advantages",
    "hidden_token_logps",
    "informative_samples",
    "make_optimizer",
    "make_schedule",
    "make_train_batch",
    "policy_loss",
    "token_logps",
    "token_weights",
    "train_step",
]
