"""Versions device to device (dora_jax/transport/weights.py): what a slice pulls from the
trainer's transfer server equals, bit for bit and by digest, what it would read from the
tensorstore tier; each offer is pulled once, and what is not on offer is refused so the caller
falls back to the tier."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dora_jax.models import ModelConfig, in_compute_dtype, init_model, logical_axes, split
from dora_jax.parallel import sharding
from dora_jax.store import ParamStore, TensorStoreTier
from dora_jax.store.digest import params_digest
from dora_jax.transport.weights import NotOffered, WeightOffer, WeightPull

CFG = ModelConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
)


def test_a_pulled_version_equals_the_tier_and_each_offer_is_pulled_once(tmp_path):
    model = init_model(CFG, seed=3)
    _, params = split(model)
    axes = logical_axes(model)
    slices = sharding.split_devices({"fsdp": 2, "tensor": 2}, {"tensor": 2}, 2)  # devices 0-3 | 4-5 | 6-7
    trainer_params = jax.device_put(
        in_compute_dtype(params, jnp.bfloat16),
        sharding.tree_shardings(axes, params, slices.trainer, sharding.TRAINER_RULES),
    )
    rollout_sh = sharding.tree_shardings(axes, params, slices.rollout[1], sharding.ROLLOUT_RULES)
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=s), trainer_params, rollout_sh
    )
    store = ParamStore(TensorStoreTier(str(tmp_path / "versions")))
    store.publish(5, trainer_params)

    offer = WeightOffer(
        slices.trainer.devices.reshape(-1), {"tensor": 2}, axes, jnp.bfloat16, 2, str(tmp_path), host="127.0.0.1"
    )
    offer.offer(5, trainer_params)
    assert offer.bytes_per_version == sum(x.nbytes for x in jax.tree.leaves(trainer_params))
    pull = WeightPull(slices.rollout[1].devices.reshape(-1), str(tmp_path), slice_id=1, host="127.0.0.1")
    pulled = pull.pull(5, abstract)
    from_tier = store.get(5, rollout_sh)
    for x, y, s in zip(jax.tree.leaves(pulled), jax.tree.leaves(from_tier), jax.tree.leaves(rollout_sh)):
        assert x.sharding.is_equivalent_to(s, x.ndim) and x.dtype == y.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32)))
    assert params_digest(pulled) == params_digest(from_tier)
    with pytest.raises(NotOffered, match="version 5 is not on offer for slice 1"):
        pull.pull(5, abstract)  # pulled already: the caller reads the tier
    with pytest.raises(NotOffered, match="version 6 is not on offer"):
        pull.pull(6, abstract)  # never offered (published again after a restart, say)


def test_the_trainer_needs_room_for_one_slice_layout(tmp_path):
    with pytest.raises(ValueError, match=r"mesh.rollout=\{'tensor': 8\} has 8 devices but the trainer has 4"):
        WeightOffer(jax.devices()[:4], {"tensor": 8}, {}, jnp.bfloat16, 1, str(tmp_path), host="127.0.0.1")


@pytest.mark.slow
def test_the_weights_bench_times_every_path_with_a_real_receiving_process(tmp_path):
    from dora_jax.bench import weights as bench_weights
    from dora_jax.runtime import run_config
    from tests.launch.configs import load

    results = bench_weights.main(run_config.parse(load("smoke.py")), str(tmp_path))
    on_disk = json.loads((tmp_path / "weights.json").read_text())
    assert on_disk == json.loads(json.dumps(results))
    assert [r["path"] for r in on_disk["rounds"]] == ["tier", "tier_background", "transfer"] * bench_weights.ROUNDS
    assert all(r["loaded_s"] >= r["trainer_s"] > 0 for r in on_disk["rounds"])  # loaded after the trainer started
    assert on_disk["bytes_per_version"]["transfer"] > 0 and on_disk["tier_over_transfer"] > 0
    # the background write stores the same bytes as the synchronous one
    assert on_disk["bytes_per_version"]["tier_background"] == on_disk["bytes_per_version"]["tier"] > 0
