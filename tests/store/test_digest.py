"""The params digest: the same for the same values whatever the sharding, different otherwise."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dora_jax.store.digest import params_digest


def _params():
    return {
        "w": jnp.arange(64 * 48, dtype=jnp.float32).reshape(64, 48) / 7,
        "norm": {"scale": jnp.linspace(0, 1, 16).astype(jnp.bfloat16)},
    }


def test_the_digest_does_not_depend_on_the_sharding():
    params = _params()
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    sharded = {
        "w": jax.device_put(params["w"], NamedSharding(mesh, P("x", "y"))),
        "norm": {"scale": jax.device_put(params["norm"]["scale"], NamedSharding(mesh, P("y")))},
    }
    assert params_digest(sharded) == params_digest(params)
    assert len(params_digest(params)) == 16


@pytest.mark.parametrize(
    "change",
    [
        lambda p: {**p, "w": p["w"].at[3, 4].add(1e-6)},  # one value, by one ulp or so
        lambda p: {**p, "w": p["w"][::-1]},  # the same values, moved
        lambda p: {**p, "w": p["w"].reshape(48, 64)},  # the same values, another shape
        lambda p: {"w2": p["w"], "norm": p["norm"]},  # another tree
        lambda p: {**p, "norm": {"scale": p["norm"]["scale"].astype(jnp.float16)}},  # another dtype
    ],
)
def test_any_change_changes_the_digest(change):
    params = _params()
    assert params_digest(change(params)) != params_digest(params)
