"""launch/ray_cluster.py: the `ray up` cluster file and the KubeRay manifests generated from the
three real configs and from v5e / v5p / v6e layouts (dry run: YAML written and read back, never
applied). Topologies and hosts are checked against Ray's own TPU arithmetic (ray.util.tpu)."""

import subprocess
import sys
from pathlib import Path

import ml_collections
import pytest
import yaml
from ray._private.accelerators.tpu import get_chips_per_host, infer_tpu_pod_type_from_topology
from ray.util.tpu import get_num_chips_from_topology

from launch import pod as pod_lib
from launch import ray_cluster, tpu_types
from tests.launch.configs import load

ROOT = Path(__file__).resolve().parents[2]


def _config(name: str, **pod_fields):
    c = load(name)
    c.pod.project = "my-project"
    if c.pod.layout != "single_host":
        c.pod.workdir = "gs://my-bucket/run1"
    with c.unlocked():
        for field, value in pod_fields.items():
            if field in ("mesh_trainer", "mesh_rollout"):
                setattr(c.mesh, field.split("_")[1], ml_collections.ConfigDict(value))
            elif field == "num_slices":
                c.rollout.num_slices = value
            else:
                c.pod[field] = value
    return c


def _roundtrip(document: dict) -> dict:
    return yaml.safe_load(yaml.safe_dump(document, sort_keys=False))


@pytest.mark.parametrize(
    "name, topology, hosts, chips_per_host",
    [
        ("v5p-8", "2x2x1", 1, 4),
        ("v5p-32", "2x2x4", 4, 4),
        ("v5p-64", "2x4x4", 8, 4),
        ("v4-16", "2x2x2", 2, 4),
        ("v5litepod-8", "2x4", 1, 8),
        ("v5litepod-16", "4x4", 4, 4),
        ("v6e-4", "2x2", 1, 4),
        ("v6e-16", "4x4", 4, 4),
        ("v6e-256", "16x16", 64, 4),
    ],
)
def test_topology_and_hosts_agree_with_ray(name, topology, hosts, chips_per_host):
    tpu = tpu_types.lookup(name, "pod.trainer_type")
    assert ray_cluster.topology(tpu) == topology
    assert (tpu.hosts, tpu.chips_per_host) == (hosts, chips_per_host)
    version = ray_cluster.RAY_ACCELERATOR_VERSION[tpu.generation]
    assert get_num_chips_from_topology(topology) == tpu.chips
    assert get_chips_per_host(topology, version) == chips_per_host
    # The head resource Ray gives a slice's worker 0 is named after the same pod type as ours.
    assert infer_tpu_pod_type_from_topology(topology, f"TPU-{version.upper()}") == name


def test_dapo_7b_gce_cluster_file():
    pod = pod_lib.from_config(_config("qwen2_5_7b_dapo.py"))
    cluster = _roundtrip(ray_cluster.gce_cluster(pod))
    assert cluster["provider"] == {
        "type": "gcp",
        "region": "us-east5",
        "availability_zone": "us-east5-a",
        "project_id": "my-project",
    }
    types = cluster["available_node_types"]
    assert set(types) == {"head", "tpu_trainer", "tpu_rollout"}
    assert types["tpu_trainer"]["node_config"]["acceleratorType"] == "v5p-32"
    assert (types["tpu_trainer"]["min_workers"], types["tpu_trainer"]["max_workers"]) == (1, 1)
    assert types["tpu_trainer"]["resources"] == {"TPU": 4}
    assert types["tpu_rollout"]["node_config"]["acceleratorType"] == "v5p-8"
    assert (types["tpu_rollout"]["min_workers"], types["tpu_rollout"]["max_workers"]) == (4, 4)
    assert types["tpu_rollout"]["node_config"]["runtimeVersion"] == "v2-alpha-tpuv5"
    assert types["tpu_rollout"]["node_config"]["schedulingConfig"] == {"preemptible": True}  # pod.provisioning=spot
    assert cluster["max_workers"] == 5 and cluster["head_node_type"] == "head"
    setup = " && ".join(cluster["setup_commands"])
    assert "uv venv -q --python 3.12" in setup and "jax[tpu]==0.10.2" in setup and "-e '.[ray]'" in setup


def test_dapo_7b_and_30b_gke_manifests():
    for name, trainer_hosts in (("qwen2_5_7b_dapo.py", 4), ("qwen3_30b_a3b.py", 4)):
        config = _config(name)
        pod = pod_lib.from_config(config)
        cluster, job = ray_cluster.gke_manifests(pod, f"configs/{name}", ["--config.num_steps=5"], "img:1")
        cluster, job = _roundtrip(cluster), _roundtrip(job)
        assert cluster["kind"] == "RayCluster" and job["kind"] == "RayJob"
        assert job["spec"]["rayClusterSpec"] == cluster["spec"]
        trainer, rollout = cluster["spec"]["workerGroupSpecs"]
        assert (trainer["replicas"], trainer["numOfHosts"]) == (1, trainer_hosts)
        assert (rollout["replicas"], rollout["numOfHosts"]) == (int(config.rollout.num_slices), 1)
        for group, topology in ((trainer, "2x2x4"), (rollout, "2x2x1")):
            spec = group["template"]["spec"]
            assert spec["nodeSelector"] == {
                "cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                "cloud.google.com/gke-tpu-topology": topology,
            }
            limits = spec["containers"][0]["resources"]["limits"]
            assert limits["google.com/tpu"] == "4"
        assert job["spec"]["entrypoint"] == (
            f"python -m dora_jax.launch_ray --config=configs/{name} --workdir=gs://my-bucket/run1 --config.num_steps=5"
        )


def test_single_host_v5e_and_v6e_layouts():
    pod = pod_lib.from_config(_config("qwen2_5_0_5b_gsm8k.py"))
    (group,) = ray_cluster.slice_groups(pod)
    assert (group.name, group.tpu.name, group.slices, group.topology) == ("embedded", "v5litepod-8", 1, "2x4")
    spec = _roundtrip(ray_cluster.gke_cluster_spec(pod, "img:1"))
    (workers,) = spec["workerGroupSpecs"]
    assert workers["numOfHosts"] == 1
    assert workers["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu-v5-lite-podslice"
    assert workers["template"]["spec"]["containers"][0]["resources"]["limits"]["google.com/tpu"] == "8"
    # v6e: a v6e-16 trainer (4 hosts of 4) and two v6e-4 rollout slices.
    c = _config(
        "qwen2_5_7b_dapo.py",
        zone="us-east5-b",
        trainer_type="v6e-16",
        rollout_type="v6e-4",
        num_slices=2,
        mesh_trainer={"fsdp": 16},
        mesh_rollout={"tensor": 4},
    )
    pod = pod_lib.from_config(c)
    trainer, rollout = _roundtrip(ray_cluster.gke_cluster_spec(pod, "img:1"))["workerGroupSpecs"]
    assert (
        trainer["numOfHosts"],
        trainer["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-topology"],
    ) == (
        4,
        "4x4",
    )
    assert (rollout["replicas"], rollout["numOfHosts"]) == (2, 1)
    assert rollout["template"]["spec"]["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
        "cloud.google.com/gke-tpu-topology": "2x2",
    }
    gce = ray_cluster.gce_cluster(pod)["available_node_types"]
    assert (
        gce["tpu_trainer"]["resources"] == {"TPU": 4}
        and gce["tpu_rollout"]["node_config"]["acceleratorType"] == "v6e-4"
    )


def test_the_command_writes_valid_yaml(tmp_path):
    for target, names in (("gce", ["ray_cluster.yaml"]), ("gke", ["raycluster.yaml", "rayjob.yaml"])):
        out = tmp_path / target
        result = subprocess.run(
            [
                sys.executable,
                "launch/ray_cluster.py",
                target,
                "--config=configs/qwen2_5_7b_dapo.py",
                f"--out={out}",
                "--config.pod.project=my-project",
                "--workdir=gs://my-bucket/run1",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert sorted(p.name for p in out.iterdir()) == sorted(names)
        for name in names:
            assert yaml.safe_load((out / name).read_text())
    job = yaml.safe_load((tmp_path / "gke" / "rayjob.yaml").read_text())
    assert "--config.pod.project=my-project" in job["spec"]["entrypoint"]


def test_a_config_error_names_the_field(tmp_path):
    result = subprocess.run(
        [sys.executable, "launch/ray_cluster.py", "gce", "--config=configs/qwen2_5_7b_dapo.py", f"--out={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and not list(tmp_path.iterdir())
    assert "pod.project, pod.workdir still hold a YOUR_... placeholder" in result.stderr
