"""Ray cluster definitions generated from an experiment config's `pod` section, so they stay in
step with its meshes: a `ray up` cluster file for Cloud TPU VMs and KubeRay `RayCluster` /
`RayJob` manifests for GKE TPU node pools.

    python launch/ray_cluster.py gce --config=configs/qwen2_5_7b_dapo.py --out=DIR   # DIR/ray_cluster.yaml
    python launch/ray_cluster.py gke --config=configs/qwen2_5_7b_dapo.py --out=DIR   # raycluster.yaml, rayjob.yaml
    ray up DIR/ray_cluster.yaml && ray job submit -- python -m dora_jax.launch_ray --config=C --workdir=W
    kubectl apply -f DIR/rayjob.yaml

One worker group (GKE) or node type (GCE) per slice type: the trainer slice and the rollout
slices, `replicas` / `min_workers` counting slices and `numOfHosts` the hosts of one slice (a
multi-host slice is scheduled whole). Each TPU host advertises `TPU: <chips per host>`, and Ray
adds `TPU-<type>-head` to a slice's worker 0: what `ray.util.tpu.slice_placement_group` (the Ray
placement, `dora_jax/cli/launch_ray.py`) reserves. The head is a CPU machine that also runs the
coordinator actor. Nothing here calls gcloud or kubectl; `--config.X=Y` overrides apply first.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python launch/ray_cluster.py`: make the `launch` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402  (pyyaml comes with the `ray` extra)

from dora_jax.core import tpu_slices  # noqa: E402
from launch import commands  # noqa: E402
from launch.pod import Layout, Pod, Role  # noqa: E402
from launch.tpu_types import TpuType  # noqa: E402

RAY_VERSION = "2.60.0"  # the `ray` extra's pin (pyproject.toml)
HEAD_MACHINE = "n2-standard-16"  # the head: coordinator actor, Ray's GCS and dashboard
SRC = "~/dora_jax"  # where the cluster launcher syncs the tree on every node

# GKE's `cloud.google.com/gke-tpu-accelerator` node label per TPU generation (launch/tpu_types.py prefixes).
GKE_ACCELERATOR = {
    "v4": "tpu-v4-podslice",
    "v5litepod": "tpu-v5-lite-podslice",
    "v5p": "tpu-v5p-slice",
    "v6e": "tpu-v6e-slice",
}
# Ray's accelerator version names (`ray.util.tpu.slice_placement_group(topology, accelerator_version)`).
RAY_ACCELERATOR_VERSION = {"v4": "v4", "v5litepod": "v5litepod", "v5p": "v5p", "v6e": "v6e"}


@dataclasses.dataclass(frozen=True)
class SliceGroup:
    """Identical slices of one role: the trainer slice, or the rollout slices."""

    name: str  # "trainer" | "rollout"
    tpu: TpuType
    slices: int
    runtime_version: str

    @property
    def topology(self) -> str:
        return topology(self.tpu)

    @property
    def accelerator_version(self) -> str:
        return RAY_ACCELERATOR_VERSION[self.tpu.generation]


def topology(tpu: TpuType) -> str:
    """The chip topology of an accelerator type: `v5p-32` (16 chips) "2x2x4", `v6e-16` "4x4"."""
    return tpu_slices.topology(tpu.name)


def slice_groups(pod: Pod) -> tuple[SliceGroup, ...]:
    """The trainer slice and the rollout slices of a multi-node pod (a single host is one group)."""
    if pod.layout is Layout.SINGLE_HOST:
        node = pod.trainer
        return (SliceGroup("embedded", node.tpu, 1, node.runtime_version),)
    rollout = pod.rollout_nodes
    return (
        SliceGroup("trainer", pod.trainer.tpu, 1, pod.trainer.runtime_version),
        SliceGroup("rollout", rollout[0].tpu, len(rollout), rollout[0].runtime_version),
    )


def _setup_commands(pod: Pod) -> list[str]:
    """What every node runs once: a Python `pod.python` environment made with uv (the TPU VM images
    ship 3.10), jax[tpu] on TPU hosts, Ray and the package with its `ray` extra."""
    venv_python = f"{SRC}/.venv/bin/python"
    return [
        "python3 -m pip install -q --user --upgrade uv",
        f"cd {SRC} && {{ test -x .venv/bin/python || ~/.local/bin/uv venv -q --python {pod.python} .venv; }}",
        f"cd {SRC} && ~/.local/bin/uv pip install -q --python {venv_python} {shlex.quote(pod.jax_tpu)} "
        f"-f {commands.JAX_TPU_FIND_LINKS}",
        f"cd {SRC} && ~/.local/bin/uv pip install -q --python {venv_python} -e '.[ray]'",
        f'grep -q "{SRC}/.venv/bin" ~/.bashrc || echo "export PATH={SRC}/.venv/bin:\\$PATH" >> ~/.bashrc',
    ]


def gce_cluster(pod: Pod) -> dict:
    """A `ray up` cluster file for Cloud TPU VMs: a CPU head and one node type per slice group."""
    node_types = {
        "head": {
            "min_workers": 0,
            "max_workers": 0,
            "resources": {"CPU": 4},  # the coordinator actor and the driver; no role touches a TPU here
            "node_config": {
                "machineType": HEAD_MACHINE,
                "disks": [
                    {
                        "boot": True,
                        "autoDelete": True,
                        "type": "PERSISTENT",
                        "initializeParams": {
                            "diskSizeGb": 100,
                            "sourceImage": "projects/ubuntu-os-cloud/global/images/family/ubuntu-2204-lts",
                        },
                    }
                ],
            },
        }
    }
    for group in slice_groups(pod):
        node_config = {"acceleratorType": group.tpu.name, "runtimeVersion": group.runtime_version}
        if pod.provisioning.value in ("spot", "preemptible"):
            node_config["schedulingConfig"] = {"preemptible": True}
        node_types[f"tpu_{group.name}"] = {
            "min_workers": group.slices,
            "max_workers": group.slices,
            "resources": {"TPU": group.tpu.chips_per_host},
            "node_config": node_config,
        }
    return {
        "cluster_name": pod.name,
        "max_workers": sum(g.slices for g in slice_groups(pod)),
        "provider": {
            "type": "gcp",
            "region": pod.zone.rsplit("-", 1)[0],
            "availability_zone": pod.zone,
            "project_id": pod.project,
        },
        "available_node_types": node_types,
        "head_node_type": "head",
        "file_mounts": {SRC: "."},
        "rsync_exclude": [".git", ".venv", "**/__pycache__"],
        "setup_commands": _setup_commands(pod),
        "head_start_ray_commands": [
            "ray stop",
            "ray start --head --port=6379 --dashboard-host=0.0.0.0 --autoscaling-config=~/ray_bootstrap_config.yaml",
        ],
        "worker_start_ray_commands": ["ray stop", "ray start --address=$RAY_HEAD_IP:6379"],
    }


def _container(name: str, image: str, limits: dict) -> dict:
    return {
        "name": name,
        "image": image,
        "resources": {"limits": dict(limits), "requests": dict(limits)},
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
    }


def gke_cluster_spec(pod: Pod, image: str) -> dict:
    """A KubeRay `RayCluster` spec for GKE TPU node pools: one worker group per slice group, each
    replica one slice of `numOfHosts` pods, each pod a TPU host (`google.com/tpu` chips)."""
    groups = []
    for group in slice_groups(pod):
        chips = str(group.tpu.chips_per_host)
        groups.append(
            {
                "groupName": f"tpu-{group.name}",
                "replicas": group.slices,
                "minReplicas": group.slices,
                "maxReplicas": group.slices,
                "numOfHosts": group.tpu.hosts,
                "rayStartParams": {},
                "template": {
                    "spec": {
                        "containers": [
                            _container("ray-worker", image, {"google.com/tpu": chips, "cpu": "8", "memory": "64Gi"})
                        ],
                        "nodeSelector": {
                            "cloud.google.com/gke-tpu-accelerator": GKE_ACCELERATOR[group.tpu.generation],
                            "cloud.google.com/gke-tpu-topology": group.topology,
                        },
                    }
                },
            }
        )
    head = _container("ray-head", image, {"cpu": "8", "memory": "32Gi"})
    head["ports"] = [
        {"containerPort": 6379, "name": "gcs"},
        {"containerPort": 8265, "name": "dashboard"},
        {"containerPort": 10001, "name": "client"},
    ]
    return {
        "rayVersion": RAY_VERSION,
        "headGroupSpec": {
            "rayStartParams": {"dashboard-host": "0.0.0.0"},
            "template": {"spec": {"containers": [head]}},
        },
        "workerGroupSpecs": groups,
    }


def gke_manifests(pod: Pod, config_path: str, overrides: list[str], image: str) -> tuple[dict, dict]:
    """(RayCluster, RayJob): the cluster alone, and a job that brings its own cluster up, runs
    `python -m dora_jax.launch_ray` on it and tears it down when the run ends."""
    spec = gke_cluster_spec(pod, image)
    cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": pod.name}, "spec": spec}
    entrypoint = shlex.join(
        ["python", "-m", "dora_jax.launch_ray", f"--config={config_path}", f"--workdir={pod.workdir}", *overrides]
    )
    job = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": f"{pod.name}-job"},
        "spec": {
            "entrypoint": entrypoint,
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 600,
            "rayClusterSpec": spec,
        },
    }
    return cluster, job


def write(documents: dict[str, dict], out_dir: str) -> list[str]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, document in documents.items():
        path = out / name
        path.write_text(yaml.safe_dump(document, sort_keys=False))
        paths.append(str(path))
    return paths


def _main(argv, flags_) -> None:
    from launch import pod as pod_lib
    from launch.tpu import config_overrides

    if len(argv) != 2 or argv[1] not in ("gce", "gke"):
        raise SystemExit("usage: python launch/ray_cluster.py <gce|gke> --config=configs/X.py --out=DIR")
    config = flags_.config.value
    try:
        pod = pod_lib.from_config(config, workdir=flags_.workdir.value or "")
    except ValueError as error:
        raise SystemExit(f"launch/ray_cluster.py: config error: {error}") from None
    unset = pod_lib.placeholders(config)
    if flags_.workdir.value:
        unset = [f for f in unset if f != "pod.workdir"]
    written = sorted({"pod.project", "pod.zone", "pod.workdir"} & set(unset))
    if written:  # these go into the files themselves
        raise SystemExit(
            f"launch/ray_cluster.py: config error: {', '.join(written)} still hold a {pod_lib.PLACEHOLDER}... "
            "placeholder; set them in the config or with --config.FIELD=VALUE (--workdir for the workdir)"
        )
    if unset:  # read by the roles when the job runs, not by the cluster
        print(f"warning: still {pod_lib.PLACEHOLDER}... placeholders: {', '.join(unset)}", file=sys.stderr)
    if pod.layout is Layout.MULTISLICE or any(n.role is Role.EMBEDDED for n in pod.nodes[1:]):
        raise SystemExit("launch/ray_cluster.py: pod.layout='multislice' is not supported here; use 'slices'")
    if argv[1] == "gce":
        documents = {"ray_cluster.yaml": gce_cluster(pod)}
    else:
        from ml_collections import config_flags

        config_path = config_flags.get_config_filename(flags_.flags.FLAGS["config"])
        cluster, job = gke_manifests(pod, config_path, config_overrides(sys.argv), flags_.image.value)
        documents = {"raycluster.yaml": cluster, "rayjob.yaml": job}
    for path in write(documents, flags_.out.value):
        print(path)


class _Flags:
    """absl flags, defined only when run as a program (importing this module defines none)."""

    def __init__(self):
        from absl import flags
        from ml_collections import config_flags

        self.flags = flags
        self.config = config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=True)
        self.out = flags.DEFINE_string("out", "ray_cluster", "directory to write the cluster files into")
        self.workdir = flags.DEFINE_string("workdir", None, "run directory (gs://); default: pod.workdir")
        self.image = flags.DEFINE_string(
            "image", f"rayproject/ray:{RAY_VERSION}-py312", "gke: the container image (with the package installed)"
        )


if __name__ == "__main__":
    from absl import app

    _FLAGS = _Flags()
    app.run(lambda argv: _main(argv, _FLAGS))
