"""The whole trainer moves the policy the right way: after a few steps, rows with a positive group
advantage are more likely and rows with a negative one less likely (no sign slips anywhere between
rewards, advantages, loss and optimizer)."""

import jax
import numpy as np
import pytest

from dora_jax import models
from dora_jax.core.records import TrainBatch
from dora_jax.parallel import sharding
from dora_jax.store import InProcessTier, ParamStore
from dora_jax.trainer import Trainer, TrainerConfig


def _batch(tokens, mask, rewards, inference, version):
    B = tokens.shape[0]
    return TrainBatch(
        tokens,
        mask,
        inference,
        rewards,
        np.ones(B, np.float32),
        np.full(B, version, np.int64),
        np.repeat(np.arange(B // 4), 4).astype(np.int32),
        tuple(map(str, range(B))),
    )


@pytest.mark.slow
def test_steps_raise_rewarded_rows_and_lower_the_rest():
    cfg = models.ModelConfig(
        vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
    )
    model = models.init_model(cfg, 0)
    graphdef, params = models.split(model)
    mesh = sharding.make_mesh(jax.devices()[:2], {"fsdp": 2})
    store = ParamStore(InProcessTier())
    trainer = Trainer(
        graphdef,
        params,
        models.logical_axes(model),
        mesh,
        TrainerConfig(lr=3e-3, micro_batch_size=8, tis_cap=2.0),
        store,
    )
    trainer.publish()
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 32, (8, 16)).astype(np.int32)
    mask = np.zeros((8, 16), np.float32)
    mask[:, 6:] = 1.0
    rewards = np.array([1, 0, 0, 0, 0, 1, 1, 0], np.float32)
    before = trainer.behaviour_logps(_batch(tokens, mask, rewards, np.zeros_like(mask), 0))
    batch = _batch(tokens, mask, rewards, before * mask, 0)
    for _ in range(3):
        trainer.train_step(batch)
    trainer.publish()
    after = trainer.behaviour_logps(_batch(tokens, mask, rewards, before * mask, trainer.version))
    delta = ((after - before) * mask).sum(axis=1)
    assert np.all(delta[rewards == 1] > 0.5), delta
    assert np.all(delta[rewards == 0] < -0.5), delta
