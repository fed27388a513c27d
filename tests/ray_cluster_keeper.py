"""A local Ray cluster of fake TPU hosts, kept by a process of its own for tests/test_launch_ray.py:
`python -m tests.ray_cluster_keeper '<slices as JSON>'` starts `ray.cluster_utils.Cluster` with
one node per fake host (`launch_ray.fake_tpu_node_args`), prints `{"address": ...}` on one line,
then reads commands on stdin, one per line, answering each on stdout:

  kill <namespace> <actor>   `ray.kill` of that named actor, Ray restarting it (`no_restart=False`)

and shuts the cluster down at end of input. The test process itself never loads Ray's core
worker: a Ray driver (its threads and its own gRPC) in the pytest process outlived `ray.shutdown`
beside the later in-process tests."""

from __future__ import annotations

import json
import sys

import ray
from ray.cluster_utils import Cluster

from dora_jax.cli.launch_ray import fake_tpu_node_args


def main(slices: dict[str, list]) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    try:
        for name, (tpu_type, hosts) in slices.items():
            for host in range(hosts):
                cluster.add_node(**fake_tpu_node_args(tpu_type, f"slice-{name}", host))
        cluster.wait_for_nodes()
        print(json.dumps({"address": cluster.address}), flush=True)
        for line in sys.stdin:
            match line.split():
                case ["kill", namespace, actor]:
                    if not ray.is_initialized():
                        ray.init(address=cluster.address)
                    ray.kill(ray.get_actor(actor, namespace=namespace), no_restart=False)
                    print(json.dumps({"killed": actor}), flush=True)
                case _:
                    print(json.dumps({"error": f"unknown command {line.strip()!r}"}), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
