"""A second process for the tensorstore-tier tests (run as a script, with its own fake devices).

read ROOT VERSION OUT.npz : opens ROOT read-only on a 4-device mesh with rollout rules, gets
                            VERSION and saves every leaf (keyed by its path) plus its sharding.
write ROOT MB             : publishes version 1 (small) then version 2 with MB megabytes of
                            params, printing a line before each; the parent kills it mid-write.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dora_jax.models import ModelConfig, abstract_model, logical_axes, split  # noqa: E402
from dora_jax.parallel import sharding  # noqa: E402
from dora_jax.store import ParamStore, TensorStoreTier  # noqa: E402

CFG = ModelConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
)


def read(root: str, version: int, out: str) -> None:
    model = abstract_model(CFG)
    _, params = split(model)
    mesh = sharding.make_mesh(jax.devices(), {"data": 2, "tensor": 2})
    shardings = sharding.tree_shardings(logical_axes(model), params, mesh, sharding.ROLLOUT_RULES)
    store = ParamStore(TensorStoreTier(root, read_only=True))
    got = store.get(version, shardings)
    leaves = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(got):
        key = jax.tree_util.keystr(path)
        assert leaf.sharding.mesh.devices.size == 4, leaf.sharding
        leaves[key] = np.asarray(leaf)
        leaves[key + ":spec"] = np.asarray(str(leaf.sharding.spec))
    np.savez(out, versions=np.asarray(store.versions()), **leaves)


def write(root: str, megabytes: int) -> None:
    store = ParamStore(TensorStoreTier(root, compression=False))
    mesh = sharding.make_mesh(jax.devices(), {"fsdp": 4})
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    store.publish(1, {"w": jax.device_put(jnp.ones((1024,)), spec)})
    print("published 1", flush=True)
    rows = megabytes * 2**20 // (4 * 1024)
    key = jax.random.key(0)
    big = {
        f"w{i}": jax.device_put(jax.random.normal(jax.random.fold_in(key, i), (rows // 8, 1024)), spec)
        for i in range(8)
    }
    jax.block_until_ready(big)
    print("writing 2", flush=True)
    store.publish(2, big)
    print("published 2", flush=True)


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    if role == "read":
        read(args[0], int(args[1]), args[2])
    elif role == "write":
        write(args[0], int(args[1]))
    else:
        raise SystemExit(f"unknown role {role!r}; expected read or write")
