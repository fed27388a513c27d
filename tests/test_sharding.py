"""Slices, rule tables and layouts on 8 fake CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from dora_jax.models import ModelConfig, init_model, logical_axes, split
from dora_jax.parallel import sharding

CFG = ModelConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
)


def test_eight_fake_devices():
    assert jax.device_count() == 8


def test_split_devices_is_disjoint():
    slices = sharding.split_devices({"fsdp": 2, "tensor": 2}, {"tensor": 2}, 2)
    ids = [d.id for d in slices.trainer.devices.flat]
    for mesh in slices.rollout:
        ids += [d.id for d in mesh.devices.flat]
    assert sorted(ids) == list(range(8))
    assert slices.trainer.shape == {"data": 1, "fsdp": 2, "tensor": 2, "expert": 1}
    assert not slices.time_shared


def test_split_asking_too_much_is_an_error():
    with pytest.raises(ValueError, match=r"asks for 10 devices .* only 8 exist.*time_shared"):
        sharding.split_devices({"fsdp": 4}, {"tensor": 2}, 3)


def test_time_shared_split_reuses_devices():
    slices = sharding.split_devices({"fsdp": 4}, {"tensor": 2}, 3, time_shared=True)
    assert slices.time_shared and len(slices.rollout) == 3


def test_unknown_mesh_axis_is_named():
    with pytest.raises(ValueError, match=r"unknown axes \['model'\]"):
        sharding.make_mesh(jax.devices()[:2], {"model": 2})


def test_rule_table_specs():
    mesh = sharding.make_mesh(jax.devices()[:4], {"fsdp": 2, "tensor": 2})
    rules = sharding.TRAINER_RULES
    assert sharding.logical_to_spec(("embed", "mlp"), (64, 128), mesh, rules) == P("fsdp", "tensor")
    assert sharding.logical_to_spec(("vocab", "embed"), (128, 64), mesh, rules) == P("tensor", "fsdp")
    # not divisible -> replicated along that dimension, never an error
    assert sharding.logical_to_spec(("embed", "kv_heads", "head_dim"), (64, 1, 16), mesh, rules) == P(
        "fsdp", None, None
    )
    with pytest.raises(ValueError, match=r"logical axis 'bogus' has no rule"):
        sharding.logical_to_spec(("bogus",), (4,), mesh, rules)
    # rows over data x fsdp x expert; as many leading axes as divide them
    moe = sharding.make_mesh(jax.devices()[:8], {"fsdp": 2, "expert": 4})
    assert sharding.logical_to_spec(("batch", "length"), (16, 8), moe, rules) == P(("fsdp", "expert"), None)
    assert sharding.logical_to_spec(("batch", "length"), (6, 8), moe, rules) == P("fsdp", None)
    assert sharding.logical_to_spec(("batch", "length"), (3, 8), moe, rules) == P(None, None)


def _forward(graphdef, params, ids):
    return nnx.merge(graphdef, params)(ids)


@pytest.mark.slow
def test_sharded_forward_equals_unsharded_and_layouts_move():
    model = init_model(CFG, seed=3)
    graphdef, params = split(model)
    axes = logical_axes(model)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (4, 24)), jnp.int32)
    reference = np.asarray(_forward(graphdef, params, ids))

    slices = sharding.split_devices({"fsdp": 2, "tensor": 2}, {"tensor": 2}, 2)
    trainer_sh = sharding.tree_shardings(axes, params, slices.trainer, sharding.TRAINER_RULES)
    trainer_params = sharding.reshard(params, trainer_sh)
    q = trainer_params["layers"][0]["attn"]["q_EHD"]
    assert q.sharding.spec == P("fsdp", "tensor", None)
    assert len(q.addressable_shards) == 4 and q.addressable_shards[0].data.shape == (32, 2, 16)
    batch_sh = sharding.logical_sharding(("batch", "length"), ids.shape, slices.trainer, sharding.TRAINER_RULES)
    fwd = jax.jit(_forward, static_argnums=0, in_shardings=(trainer_sh, batch_sh))
    np.testing.assert_allclose(np.asarray(fwd(graphdef, trainer_params, ids)), reference, rtol=1e-5, atol=1e-5)

    for mesh in slices.rollout:
        rollout_sh = sharding.tree_shardings(axes, params, mesh, sharding.ROLLOUT_RULES)
        rollout_params = sharding.reshard(trainer_params, rollout_sh)
        gate = rollout_params["layers"][1]["mlp"]["gate_EM"]
        assert gate.sharding.spec == P(None, "tensor") and set(gate.devices()) == set(mesh.devices.flat)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), rollout_params, params)
        out = jax.jit(_forward, static_argnums=0)(
            graphdef, rollout_params, jax.device_put(ids, sharding.replicated(mesh))
        )
        np.testing.assert_allclose(np.asarray(out), reference, rtol=1e-5, atol=1e-5)


def test_load_hf_places_shards_directly(tmp_path):
    from dora_jax.models import load_hf
    from tests.models.hf_fixtures import hf_logits, make_checkpoint

    torch_model = make_checkpoint("qwen2", tmp_path)
    mesh = sharding.make_mesh(jax.devices()[:4], {"fsdp": 2, "tensor": 2})
    model = load_hf(str(tmp_path), mesh=mesh)
    up = model.layers[0].mlp.up_EM[...]
    assert up.sharding.spec == P("fsdp", "tensor")
    ids = np.random.default_rng(0).integers(0, 128, (2, 10))
    ours = np.asarray(model(jnp.asarray(ids, jnp.int32)))
    ref = hf_logits(torch_model, ids)
    assert np.max(np.abs(ours - ref)) / np.max(np.abs(ref)) < 1e-3


def test_build_setup_reads_a_checkpoint_straight_into_the_trainer_shardings(tmp_path):
    """No device ever holds a whole weight matrix: each gets its own shards of every 2-D+ param."""
    import math

    from dora_jax.runtime import run_config
    from dora_jax.runtime.build import build_setup
    from tests.helpers import tiny_config
    from tests.models.hf_fixtures import make_checkpoint

    make_checkpoint("qwen2", tmp_path / "ckpt")
    c = tiny_config("dora")
    with c.unlocked():
        c.init.checkpoint = str(tmp_path / "ckpt")
    mesh = sharding.make_mesh(jax.devices()[:4], {"fsdp": 2, "tensor": 2})
    setup = build_setup(run_config.parse(c), str(tmp_path / "work"), mesh=mesh)
    targets = sharding.tree_shardings(setup.axes, setup.params, mesh, sharding.TRAINER_RULES)
    leaves = jax.tree.leaves_with_path(setup.params)
    assert len(leaves) > 10
    for (path, leaf), target in zip(leaves, jax.tree.leaves(targets)):
        assert leaf.sharding.is_equivalent_to(target, leaf.ndim), jax.tree_util.keystr(path)
        if leaf.ndim >= 2:
            shard = leaf.sharding.shard_shape(leaf.shape)
            assert math.prod(shard) <= math.prod(leaf.shape) // 2, (jax.tree_util.keystr(path), shard, leaf.shape)
            assert all(s.data.shape == shard for s in leaf.addressable_shards)
