"""Helpers shared by the end-to-end tests: the smoke config, shrunk to a tiny model and a few steps."""

import os

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "smoke.py")


def smoke_config():
    """configs/smoke.py's config, as `--config=configs/smoke.py` gives it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("smoke", CONFIG)
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    return smoke.get_config()


def tiny_config(mode: str, steps: int = 4):
    c = smoke_config()
    with c.unlocked():
        c.mode = mode
        c.num_steps = steps
        c.compile_ahead = False  # a few steps: compile only the programs they use
        c.init.sft_steps = 0
        c.model.hidden_size, c.model.intermediate_size, c.model.head_dim = 64, 128, 16
        c.rollout.num_slices = 3
        c.rollout.slots = 4
        c.rollout.cache_length = 128
        c.rollout.max_prefill_length = 64
        c.rollout.max_new_tokens = 40
        c.task.k_max = 20
        c.coordinator.train_batch_size = 8
        c.coordinator.rollout_batch_size = 16
        c.coordinator.group_size = 4
        c.trainer.micro_batch_size = 8
        c.log.tensorboard = True
        c.eval.every_steps = 0  # the evaluation tests turn it on
    return c
