"""`python -m dora_jax.bench weights --config=C --out=DIR`: how long a published version takes to
reach a rollout slice's devices, and how many bytes move, by each path, with real processes.

This process plays the trainer (its params on `mesh.trainer`'s devices, in the served dtype); a
child process plays one rollout slice (`mesh.rollout`'s devices, its own shardings). For each of
`ROUNDS` versions, interleaved: the tensorstore tier (the trainer writes the version to
DIR/versions, the slice reads it), the same with the write in the background (the trainer role's
way: `TensorStoreTier(background_writes=True)`, DIR/versions_background; the slice reads the
version once it is committed) and the transfer server (the trainer lays the version out as the
slice's shards and offers it, the slice pulls it; dora_jax/transport/weights.py). Publish-to-loaded
is the wall time from the trainer starting its publish to the params being ready on the slice's
devices (both processes on this host's clock); the trainer's own share (write, or copy and offer)
is reported beside it. Writes DIR/weights.json.
"""

from __future__ import annotations

import json
import os
import pickle
import statistics
import subprocess
import sys
import time

ROUNDS = 5
PATHS = ("tier", "tier_background", "transfer")


def main(config, out_dir: str) -> dict:
    import jax

    from dora_jax.models import init_model, logical_axes, split
    from dora_jax.models.params import in_compute_dtype
    from dora_jax.parallel import sharding
    from dora_jax.runtime.build import fresh_model_config, make_tokenizer
    from dora_jax.store import ParamStore, TensorStoreTier
    from dora_jax.transport.weights import WeightOffer

    tokenizer = make_tokenizer(config)
    model_config = fresh_model_config(config, tokenizer.vocab_size, tokenizer.eos_ids)
    model = init_model(model_config)
    _, params = split(model)
    axes = logical_axes(model)
    trainer_shape, rollout_shape = dict(config.mesh.trainer), dict(config.mesh.rollout)
    devices = jax.devices()[: sharding.mesh_size(trainer_shape)]
    mesh = sharding.make_mesh(devices, trainer_shape)
    served = jax.device_put(
        in_compute_dtype(params, model_config.dtype),
        sharding.tree_shardings(axes, params, mesh, sharding.TRAINER_RULES),
    )
    stores = {
        "tier": ParamStore(TensorStoreTier(os.path.join(out_dir, "versions"))),
        "tier_background": ParamStore(
            TensorStoreTier(os.path.join(out_dir, "versions_background"), background_writes=True)
        ),
    }
    for store in stores.values():
        store.rollback_to(-1)
    offer = WeightOffer(devices, rollout_shape, axes, model_config.dtype, 1, out_dir, host="127.0.0.1")
    child = _start_receiver(model_config, axes, rollout_shape, out_dir)
    rows, tier_bytes = [], 0
    try:
        for version in range(len(PATHS) * ROUNDS):
            path = PATHS[version % len(PATHS)]
            t0 = time.time()
            if path in stores:
                before = stores[path].bytes_by_tier()["tensorstore"]
                stores[path].publish(version, served)
            else:
                offer.offer(version, served)
            trainer_s = time.time() - t0
            child.stdin.write(json.dumps({"version": version, "path": path}) + "\n")
            child.stdin.flush()
            loaded = json.loads(child.stdout.readline())
            rows.append({"path": path, "version": version, "trainer_s": trainer_s, "loaded_s": loaded["t"] - t0})
            if path in stores:
                stores[path].flush()
                tier_bytes = stores[path].bytes_by_tier()["tensorstore"] - before  # as stored
                stores[path].retire_below(version)
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    bytes_per_version = offer.bytes_per_version
    results = {
        "model": {"hidden_size": model_config.hidden_size, "num_layers": model_config.num_layers},
        "dtype": str(model_config.dtype.__name__ if hasattr(model_config.dtype, "__name__") else model_config.dtype),
        "mesh": {"trainer": trainer_shape, "rollout": rollout_shape},
        "bytes_per_version": {"tier": tier_bytes, "tier_background": tier_bytes, "transfer": bytes_per_version},
        "rounds": rows,
    }
    for path in PATHS:
        mine = [r for r in rows if r["path"] == path]
        results[path] = {
            "publish_to_loaded_s_median": statistics.median(r["loaded_s"] for r in mine),
            "trainer_s_median": statistics.median(r["trainer_s"] for r in mine),
        }
    results["tier_over_transfer"] = (
        results["tier"]["publish_to_loaded_s_median"] / results["transfer"]["publish_to_loaded_s_median"]
    )
    with open(os.path.join(out_dir, "weights.json"), "w") as f:
        json.dump(results, f, indent=1)
    return results


def format_table(results: dict) -> str:
    lines = [f"{results['dtype']} versions; medians of {ROUNDS} versions per path"]
    for path in PATHS:
        r, mib = results[path], results["bytes_per_version"][path] / 2**20
        lines.append(
            f"{path:15s} {mib:8.1f} MiB  publish-to-loaded {r['publish_to_loaded_s_median']:.3f} s "
            f"(trainer {r['trainer_s_median']:.3f} s)"
        )
    return "\n".join(lines)


def _start_receiver(model_config, axes, rollout_shape, out_dir) -> subprocess.Popen:
    env = dict(os.environ)
    flags_ = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    size = 1
    for n in rollout_shape.values():
        size *= int(n)
    env["XLA_FLAGS"] = " ".join(flags_ + [f"--xla_force_host_platform_device_count={size}"])
    env["JAX_PLATFORMS"] = "cpu"
    child = subprocess.Popen(
        [sys.executable, "-c", "from dora_jax.bench import weights; weights.receive()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    child.stdin.write(pickle.dumps((model_config, axes, rollout_shape, out_dir)).hex() + "\n")
    child.stdin.flush()
    return child


def receive() -> None:
    """The rollout slice's side: loads each announced version by the announced path."""
    import jax

    from dora_jax.models import abstract_model, served_abstract, split
    from dora_jax.parallel import sharding
    from dora_jax.store import ParamStore, TensorStoreTier
    from dora_jax.transport.rollout_agent import fetch_from_store
    from dora_jax.transport.weights import WeightPull

    model_config, axes, rollout_shape, out_dir = pickle.loads(bytes.fromhex(sys.stdin.readline().strip()))
    mesh = sharding.make_mesh(jax.devices(), rollout_shape)
    abstract = split(abstract_model(model_config))[1]
    shardings = sharding.tree_shardings(axes, abstract, mesh, sharding.ROLLOUT_RULES)
    served = served_abstract(abstract, shardings, model_config.dtype)
    fetch = {
        path: fetch_from_store(
            ParamStore(TensorStoreTier(os.path.join(out_dir, root), read_only=True)), shardings, wait_s=60.0
        )
        for path, root in (("tier", "versions"), ("tier_background", "versions_background"))
    }
    pull = WeightPull(jax.devices(), out_dir, 0, host="127.0.0.1")
    for line in sys.stdin:
        ask = json.loads(line)
        if ask["path"] in fetch:
            params = jax.block_until_ready(fetch[ask["path"]](ask["version"]))
        else:
            params = pull.pull(ask["version"], served)
        print(json.dumps({"t": time.time()}), flush=True)
        del params
