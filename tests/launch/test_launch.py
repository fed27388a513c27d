"""launch/: the gcloud commands each action generates (dry run: printed, never run; no gcloud
binary, no network) for a v5e-8 single host, v5p trainer + rollout slices and a 2-slice multislice
queued resource, and the refusals of configs that do not fit, each naming the field."""

import io
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import ml_collections
import pytest

from launch import commands, tpu, tpu_types
from launch import pod as pod_lib
from launch.pod import Layout, Role
from tests.launch.configs import load

ROOT = Path(__file__).resolve().parents[2]
GCLOUD = ["gcloud", "compute", "tpus"]
IP = "10.128.0.7"


SA = "dora-run@my-project.iam.gserviceaccount.com"


def gsm8k_config():
    c = load("qwen2_5_0_5b_gsm8k.py")
    c.pod.project = "my-project"
    c.pod.service_account = SA
    return c


def dapo_config():
    c = load("qwen2_5_7b_dapo.py")
    c.pod.project = "my-project"
    c.pod.workdir = "gs://my-bucket/run1"
    c.pod.service_account = SA
    return c


def net(pod_name):
    """The flags that put a node on the run's network, tag and service account."""
    return [
        "--network=dora-net",
        "--subnetwork=dora-subnet",
        "--internal-ips",
        f"--tags={pod_name}-dora",
        f"--service-account={SA}",
        "--scopes=https://www.googleapis.com/auth/cloud-platform",
    ]


def firewall(pod_name, port=8470):
    return [
        "gcloud",
        "compute",
        "firewall-rules",
        "create",
        f"{pod_name}-dora-ports",
        "--project=my-project",
        "--network=dora-net",
        "--direction=INGRESS",
        "--action=ALLOW",
        f"--rules=tcp:{port},tcp:8480-8481,tcp:8476",
        f"--source-tags={pod_name}-dora",
        f"--target-tags={pod_name}-dora",
        f"--description=dora_jax run {pod_name}: coordinator, transfer and jax.distributed ports between its VMs",
    ]


def firewall_delete(pod_name):
    return [
        "gcloud",
        "compute",
        "firewall-rules",
        "delete",
        f"{pod_name}-dora-ports",
        "--project=my-project",
        "--quiet",
    ]


def node_network(pod_name):
    return {
        "networkConfig": {"network": "dora-net", "subnetwork": "dora-subnet", "enableExternalIps": False},
        "tags": [f"{pod_name}-dora"],
        "serviceAccount": {"email": SA, "scope": ["https://www.googleapis.com/auth/cloud-platform"]},
    }


def credential_commands(pod, where):
    """What `run` does before starting the roles: per node a fresh ~/dora_auth, then scp of its files."""
    out = []
    for node in pod.nodes:
        out.append(
            GCLOUD
            + [
                "tpu-vm",
                "ssh",
                node.name,
                "--worker=all",
                *where,
                "--command=rm -rf ~/dora_auth && mkdir -m 700 ~/dora_auth",
            ]
        )
        out.append(GCLOUD + ["tpu-vm", "scp"])  # its files: compared by prefix (local paths are temporary)
    return out


def without_scp_files(commands_):
    return [c[:5] if c[3:5] == ["tpu-vm", "scp"] else c for c in commands_]


def auth_env(role, slice_id=None):
    """The variables naming a role's credential files on the node (pod.tls on)."""
    if role == "coordinator":
        return (
            "DORA_RUN_SECRET_FILE=../dora_auth/run_secret DORA_TLS_CERT_FILE=../dora_auth/server.pem "
            "DORA_TLS_KEY_FILE=../dora_auth/server.key"
        )
    name = "trainer" if role == "trainer" else f"rollout-{slice_id}"
    return f"DORA_ROLE_TOKEN_FILE=../dora_auth/{name}.token DORA_TLS_CA_FILE=../dora_auth/ca.pem"


def multislice_config():
    """Two identical v5p-8 slices from one queued resource: slice 0 trains, slice 1 rolls out."""
    c = dapo_config()
    with c.unlocked():
        c.pod.layout = "multislice"
        c.pod.trainer_type = "v5p-8"
        c.pod.rollout_type = ""
        c.rollout.num_slices = 1
        c.mesh.trainer = ml_collections.ConfigDict({"fsdp": 4})
        c.mesh.rollout = ml_collections.ConfigDict({"tensor": 4})
    return c


def dry(action, pod, **kwargs):
    shell = tpu.Shell(dry_run=True, out=io.StringIO())
    tpu.execute(action, pod, shell, **kwargs)
    return shell


@pytest.fixture(autouse=True)
def no_subprocess(monkeypatch):
    """A dry run must not start anything (no gcloud here)."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"subprocess.run called in a dry run: {args}")

    monkeypatch.setattr(subprocess, "run", refuse)


def start_command(process_env, module, args, log):
    command = shlex.quote(f".venv/bin/python -m {module} {args}; echo $? > ~/dora_logs/{log}.exit")
    return (
        f"cd ~/dora_jax && mkdir -p ~/dora_logs && rm -f ~/dora_logs/{log}.exit && {{ {process_env} setsid nohup "
        f"sh -c {command} > ~/dora_logs/{log}.log 2>&1 < /dev/null & p=$!; {commands.SESSION_WAIT} "
        f"echo $p > ~/dora_logs/{log}.pid; }}"
    )


# (1) v5e-8: one host runs everything in one process.


def test_single_host_v5e_8_create_queued_and_plain():
    pod = pod_lib.from_config(gsm8k_config())
    assert pod.layout is Layout.SINGLE_HOST
    assert [(n.name, n.tpu.name, n.tpu.chips, n.tpu.hosts, n.role) for n in pod.nodes] == [
        ("dora-qwen05-gsm8k", "v5litepod-8", 8, 1, Role.EMBEDDED)
    ]
    assert dry("create", pod).commands == [
        GCLOUD
        + [
            "queued-resources",
            "create",
            "dora-qwen05-gsm8k",
            "--accelerator-type=v5litepod-8",
            "--runtime-version=v2-alpha-tpuv5-lite",
            "--node-id=dora-qwen05-gsm8k",
            "--zone=us-west4-a",
            "--project=my-project",
            "--spot",
            *net("dora-qwen05-gsm8k"),
        ]
    ]

    c = gsm8k_config()
    c.pod.queued = False
    c.pod.provisioning = "preemptible"
    assert dry("create", pod_lib.from_config(c)).commands == [
        GCLOUD
        + [
            "tpu-vm",
            "create",
            "dora-qwen05-gsm8k",
            "--accelerator-type=v5litepod-8",
            "--version=v2-alpha-tpuv5-lite",
            "--zone=us-west4-a",
            "--project=my-project",
            "--preemptible",
            *net("dora-qwen05-gsm8k"),
        ]
    ]
    c.pod.provisioning = "on_demand"
    assert dry("create", pod_lib.from_config(c)).commands[0][-7] == "--project=my-project"  # no provisioning flag


def test_single_host_setup_installs_on_every_worker(tmp_path):
    pod = pod_lib.from_config(gsm8k_config())
    shell = dry("setup", pod, archive=str(tmp_path / "src.tar.gz"))
    script = (
        "mkdir -p ~/dora_jax && tar -xzf ~/dora_jax_src.tar.gz -C ~/dora_jax && cd ~/dora_jax && "
        "python3 -m pip install -q --user --upgrade uv && "
        "{ .venv/bin/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null || "
        "{ rm -rf .venv && ~/.local/bin/uv venv -q --python 3.12 .venv; }; } && "
        "~/.local/bin/uv pip install -q --python .venv/bin/python 'jax[tpu]==0.10.2' -f "
        "https://storage.googleapis.com/jax-releases/libtpu_releases.html && "
        "~/.local/bin/uv pip install -q --python .venv/bin/python -e . && "
        "mkdir -p models/Qwen2.5-0.5B-Instruct && gcloud storage rsync --recursive "
        "gs://YOUR_BUCKET/models/Qwen2.5-0.5B-Instruct models/Qwen2.5-0.5B-Instruct"
    )
    assert shell.commands == [
        GCLOUD
        + [
            "tpu-vm",
            "scp",
            str(tmp_path / "src.tar.gz"),
            "dora-qwen05-gsm8k:~/dora_jax_src.tar.gz",
            "--worker=all",
            "--zone=us-west4-a",
            "--project=my-project",
        ],
        GCLOUD
        + [
            "tpu-vm",
            "ssh",
            "dora-qwen05-gsm8k",
            "--worker=all",
            "--zone=us-west4-a",
            "--project=my-project",
            f"--command={script}",
        ],
    ]
    assert not (tmp_path / "src.tar.gz").exists()  # a dry run packs nothing


def test_single_host_run_starts_dora_jax_train_with_overrides():
    pod = pod_lib.from_config(gsm8k_config())
    shell = dry(
        "run", pod, config_path=str(ROOT / "configs/qwen2_5_0_5b_gsm8k.py"), overrides=["--config.trainer.lr=2e-06"]
    )
    args = "--config=configs/qwen2_5_0_5b_gsm8k.py --workdir=runs/qwen2_5_0_5b_gsm8k --config.trainer.lr=2e-06"
    assert shell.commands == [
        GCLOUD
        + [
            "tpu-vm",
            "ssh",
            "dora-qwen05-gsm8k",
            "--worker=all",
            "--zone=us-west4-a",
            "--project=my-project",
            "--command=" + start_command("DORA_ROLE=embedded", "dora_jax.train", args, "embedded"),
        ]
    ]


# (2) v5p: a trainer slice and rollout slices, each its own node and JAX job.


def test_v5p_slices_come_from_one_queued_resource_of_mixed_node_specs():
    """All or nothing: the trainer is not billed while rollout capacity queues. gcloud takes one
    accelerator type per request, so the request goes to the TPU API with a nodeSpec per node."""
    pod = pod_lib.from_config(dapo_config())
    assert [r.name for r in pod.requests] == ["dora-qwen7b-dapo"] and pod.requests[0].node_specs
    rule, argv = dry("create", pod).commands
    assert rule == firewall("dora-qwen7b-dapo")
    assert argv[:2] == ["bash", "-c"]
    script = shlex.split(argv[2])
    assert script[:5] == ["curl", "-sS", "--fail-with-body", "-X", "POST"]
    assert "Authorization: Bearer $(gcloud auth print-access-token)" in argv[2]  # read in the shell, never printed
    assert script[-1] == (
        "https://tpu.googleapis.com/v2/projects/my-project/locations/us-east5-a/queuedResources"
        "?queuedResourceId=dora-qwen7b-dapo"
    )
    body = json.loads(script[script.index("-d") + 1])
    parent = "projects/my-project/locations/us-east5-a"
    assert body == {
        "tpu": {
            "nodeSpec": [
                {
                    "parent": parent,
                    "nodeId": "dora-qwen7b-dapo-trainer",
                    "node": {
                        "acceleratorType": "v5p-32",
                        "runtimeVersion": "v2-alpha-tpuv5",
                        **node_network("dora-qwen7b-dapo"),
                    },
                }
            ]
            + [
                {
                    "parent": parent,
                    "nodeId": f"dora-qwen7b-dapo-rollout-{i}",
                    "node": {
                        "acceleratorType": "v5p-8",
                        "runtimeVersion": "v2-alpha-tpuv5",
                        **node_network("dora-qwen7b-dapo"),
                    },
                }
                for i in range(4)
            ]
        },
        "spot": {},
    }
    assert dry("delete", pod).commands == [
        GCLOUD
        + ["queued-resources", "delete", "dora-qwen7b-dapo", "--force", "--quiet", "--async"]
        + ["--zone=us-east5-a", "--project=my-project"],
        firewall_delete("dora-qwen7b-dapo"),
    ]
    c = dapo_config()
    with c.unlocked():
        c.pod.queued = False
    with pytest.raises(ValueError, match="pod.queued_together=True asks for every node from one queued resource"):
        pod_lib.from_config(c)


def test_v5p_slices_create_one_queued_resource_per_node_when_not_together():
    c = dapo_config()
    with c.unlocked():
        c.pod.queued_together = False
    pod = pod_lib.from_config(c)
    assert [(n.name, n.tpu.name, n.tpu.chips, n.tpu.hosts, n.role, n.slice_id) for n in pod.nodes] == [
        ("dora-qwen7b-dapo-trainer", "v5p-32", 16, 4, Role.TRAINER, None)
    ] + [(f"dora-qwen7b-dapo-rollout-{i}", "v5p-8", 4, 1, Role.ROLLOUT, i) for i in range(4)]
    assert sum(n.tpu.chips for n in pod.nodes) == tpu_types.lookup("v5p-64", "x").chips  # a v5p-64's worth
    expected = [
        firewall("dora-qwen7b-dapo"),
        GCLOUD
        + [
            "queued-resources",
            "create",
            "dora-qwen7b-dapo-trainer",
            "--accelerator-type=v5p-32",
            "--runtime-version=v2-alpha-tpuv5",
            "--node-id=dora-qwen7b-dapo-trainer",
            "--zone=us-east5-a",
            "--project=my-project",
            "--spot",
            *net("dora-qwen7b-dapo"),
        ],
    ]
    expected += [
        GCLOUD
        + [
            "queued-resources",
            "create",
            f"dora-qwen7b-dapo-rollout-{i}",
            "--accelerator-type=v5p-8",
            "--runtime-version=v2-alpha-tpuv5",
            f"--node-id=dora-qwen7b-dapo-rollout-{i}",
            "--zone=us-east5-a",
            "--project=my-project",
            "--spot",
            *net("dora-qwen7b-dapo"),
        ]
        for i in range(4)
    ]
    assert dry("create", pod).commands == expected
    assert dry("delete", pod).commands == [
        GCLOUD
        + [
            "queued-resources",
            "delete",
            name,
            "--force",
            "--quiet",
            "--async",
            "--zone=us-east5-a",
            "--project=my-project",
        ]
        for name in [n.name for n in pod.nodes]
    ] + [firewall_delete("dora-qwen7b-dapo")]


def test_v5p_slices_setup_stages_weights_on_the_trainer_only(tmp_path):
    """Rollout slices load every version from the store: they get the checkpoint's config and
    tokenizer, not its weights; every node gets the same Python 3.12 environment."""
    pod = pod_lib.from_config(dapo_config())
    scripts = {}
    for command in dry("setup", pod, archive=str(tmp_path / "src.tar.gz")).commands:
        if "ssh" in command:
            scripts[command[command.index("ssh") + 1]] = command[-1].removeprefix("--command=")
    assert list(scripts) == [n.name for n in pod.nodes]
    rsync = "gcloud storage rsync --recursive"
    trainer = scripts.pop("dora-qwen7b-dapo-trainer")
    assert f"{rsync} gs://" in trainer and "--exclude" not in trainer
    for script in scripts.values():
        assert f"{rsync} --exclude='.*\\.(safetensors|bin|pt|pth|msgpack|h5)$' gs://" in script
        assert script.replace(script[script.index(rsync) :], "") == trainer.replace(trainer[trainer.index(rsync) :], "")
    assert "uv venv -q --python 3.12 .venv" in trainer


def test_v5p_slices_run_assigns_roles_per_slice():
    pod = pod_lib.from_config(dapo_config())
    shell = dry("run", pod, config_path="configs/qwen2_5_7b_dapo.py", coordinator_ip=IP)
    common = "--config=configs/qwen2_5_7b_dapo.py --workdir=gs://my-bucket/run1"
    where = ["--zone=us-east5-a", "--project=my-project"]
    env = f"DORA_COORDINATOR={IP}:8470"
    expected = [
        GCLOUD
        + [
            "tpu-vm",
            "ssh",
            "dora-qwen7b-dapo-trainer",
            "--worker=0",
            *where,
            "--command="
            + start_command(
                f"DORA_ROLE=coordinator {env} {auth_env('coordinator')}",
                "dora_jax.serve_coordinator",
                f"{common} --port=8470 --host={IP}",
                "coordinator",
            ),
        ],
        GCLOUD
        + [
            "tpu-vm",
            "ssh",
            "dora-qwen7b-dapo-trainer",
            "--worker=all",
            *where,
            "--command="
            + start_command(
                f"DORA_ROLE=trainer {env} {auth_env('trainer')}",
                "dora_jax.trainer_worker",
                f"{common} --coordinator={IP}:8470 --transfer_port=8480 --num_hosts=4",
                "trainer",
            ),
        ],
    ]
    expected += [
        GCLOUD
        + [
            "tpu-vm",
            "ssh",
            f"dora-qwen7b-dapo-rollout-{i}",
            "--worker=all",
            *where,
            "--command="
            + start_command(
                f"DORA_ROLE=rollout {env} DORA_SLICE_ID={i} {auth_env('rollout', i)}",
                "dora_jax.rollout_worker",
                f"{common} --coordinator={IP}:8470 --slice_id={i} --transfer_port=8480",
                f"rollout-{i}",
            ),
        ]
        for i in range(4)
    ]
    assert without_scp_files(shell.commands) == credential_commands(pod, where) + expected


def test_v5p_slices_dry_run_looks_up_the_coordinator_ip_first():
    pod = pod_lib.from_config(dapo_config())
    shell = dry("run", pod, config_path="configs/qwen2_5_7b_dapo.py")
    assert shell.commands[0] == GCLOUD + [
        "tpu-vm",
        "describe",
        "dora-qwen7b-dapo-trainer",
        "--format=value(networkEndpoints[0].ipAddress)",
        "--zone=us-east5-a",
        "--project=my-project",
    ]
    assert len(shell.commands) == 1 + 2 * 5 + 2 + 4  # the IP, credentials to 5 nodes, 6 role processes
    assert f"--host={tpu.COORDINATOR_IP_DRY_RUN}" in shell.commands[11][-1]
    assert all(f"--coordinator={tpu.COORDINATOR_IP_DRY_RUN}:8470" in c[-1] for c in shell.commands[12:])
    printed = shell.out.getvalue().splitlines()
    assert [line for line in printed if not line.startswith("#")] == [shlex.join(c) for c in shell.commands]


def test_v5p_64_trainer_with_two_host_rollout_slices():
    c = dapo_config()
    with c.unlocked():
        c.pod.trainer_type = "v5p-64"
        c.pod.rollout_type = "v5p-16"
        c.rollout.num_slices = 2
        c.mesh.trainer = ml_collections.ConfigDict({"fsdp": 32})
        c.mesh.rollout = ml_collections.ConfigDict({"tensor": 8})
    pod = pod_lib.from_config(c)
    assert [(n.tpu.name, n.tpu.chips, n.tpu.hosts) for n in pod.nodes] == [
        ("v5p-64", 32, 8),
        ("v5p-16", 8, 2),
        ("v5p-16", 8, 2),
    ]
    run = dry("run", pod, config_path="configs/qwen2_5_7b_dapo.py", coordinator_ip=IP).commands[2 * 3 :]
    assert [(cmd[5], cmd[6]) for cmd in run] == [
        ("dora-qwen7b-dapo-trainer", "--worker=0"),
        ("dora-qwen7b-dapo-trainer", "--worker=all"),
        ("dora-qwen7b-dapo-rollout-0", "--worker=all"),
        ("dora-qwen7b-dapo-rollout-1", "--worker=all"),
    ]
    # Each node is one multi-controller JAX job over its own hosts (host ids auto-detected on TPU).
    assert "--num_hosts" not in run[0][-1] and "--num_hosts=8" in run[1][-1]
    assert all("--num_hosts=2" in cmd[-1] and "--host_id" not in cmd[-1] for cmd in run[2:])


def test_a_multi_host_trainer_takes_the_bucketed_step():
    """The bucketed step gathers its recomputed rows from every host (tests/transport/test_multihost.py)."""
    c = dapo_config()
    with c.unlocked():
        c.trainer["length_bucket"] = 16
    trainer = pod_lib.from_config(c).nodes[0]
    assert (trainer.role, trainer.tpu.name, trainer.tpu.hosts) == (Role.TRAINER, "v5p-32", 4)


# (3) a 2-slice multislice queued resource.


def test_multislice_two_slices_create_one_queued_resource():
    pod = pod_lib.from_config(multislice_config())
    assert [(n.name, n.tpu.name, n.role, n.slice_id) for n in pod.nodes] == [
        ("dora-qwen7b-dapo-0", "v5p-8", Role.TRAINER, None),
        ("dora-qwen7b-dapo-1", "v5p-8", Role.ROLLOUT, 0),
    ]
    assert dry("create", pod).commands == [
        firewall("dora-qwen7b-dapo"),
        GCLOUD
        + [
            "queued-resources",
            "create",
            "dora-qwen7b-dapo",
            "--accelerator-type=v5p-8",
            "--runtime-version=v2-alpha-tpuv5",
            "--node-count=2",
            "--node-prefix=dora-qwen7b-dapo",
            "--zone=us-east5-a",
            "--project=my-project",
            "--spot",
            *net("dora-qwen7b-dapo"),
        ],
    ]
    assert dry("delete", pod).commands == [
        GCLOUD
        + [
            "queued-resources",
            "delete",
            "dora-qwen7b-dapo",
            "--force",
            "--quiet",
            "--async",
            "--zone=us-east5-a",
            "--project=my-project",
        ],
        firewall_delete("dora-qwen7b-dapo"),
    ]
    assert dry("status", pod).commands == [
        GCLOUD + ["queued-resources", "describe", "dora-qwen7b-dapo", "--zone=us-east5-a", "--project=my-project"]
    ]


def test_multislice_run_keeps_each_slice_its_own_jax_job():
    pod = pod_lib.from_config(multislice_config())
    shell = dry(
        "run", pod, config_path="configs/qwen2_5_7b_dapo.py", coordinator_ip=IP, overrides=["--config.num_steps=5"]
    )
    common = "--config=configs/qwen2_5_7b_dapo.py --workdir=gs://my-bucket/run1"
    alone = "MEGASCALE_COORDINATOR_ADDRESS='' MEGASCALE_NUM_SLICES=1 MEGASCALE_SLICE_ID=0"
    where = ["--zone=us-east5-a", "--project=my-project"]
    env = f"DORA_COORDINATOR={IP}:8470"
    assert without_scp_files(shell.commands) == credential_commands(pod, where) + [
        GCLOUD
        + [
            "tpu-vm",
            "ssh",
            "dora-qwen7b-dapo-0",
            "--worker=0",
            *where,
            "--command="
            + start_command(
                f"DORA_ROLE=coordinator {env} {alone} {auth_env('coordinator')}",
                "dora_jax.serve_coordinator",
                f"{common} --port=8470 --host={IP} --config.num_steps=5",
                "coordinator",
            ),
        ],
        GCLOUD
        + [
            "tpu-vm",
            "ssh",
            "dora-qwen7b-dapo-0",
            "--worker=all",
            *where,
            "--command="
            + start_command(
                f"DORA_ROLE=trainer {env} {alone} {auth_env('trainer')}",
                "dora_jax.trainer_worker",
                f"{common} --coordinator={IP}:8470 --transfer_port=8480 --config.num_steps=5",
                "trainer",
            ),
        ],
        GCLOUD
        + [
            "tpu-vm",
            "ssh",
            "dora-qwen7b-dapo-1",
            "--worker=all",
            *where,
            "--command="
            + start_command(
                f"DORA_ROLE=rollout {env} DORA_SLICE_ID=0 {alone} {auth_env('rollout', 0)}",
                "dora_jax.rollout_worker",
                f"{common} --coordinator={IP}:8470 --slice_id=0 --transfer_port=8480 --config.num_steps=5",
                "rollout-0",
            ),
        ],
    ]


# logs, ssh, stop, status on plain TPU VMs.


def test_logs_ssh_stop_status_address_every_node():
    c = dapo_config()
    c.pod.queued = False
    c.pod.queued_together = False
    pod = pod_lib.from_config(c)
    names = [n.name for n in pod.nodes]
    where = ["--zone=us-east5-a", "--project=my-project"]
    logs = dry("logs", pod, lines=20).commands
    assert [cmd[5:7] for cmd in logs] == [[name, "--worker=all"] for name in names]
    assert "tail -n 20" in logs[0][-1]
    stop = dry("stop", pod).commands
    assert [cmd[5:7] for cmd in stop] == [[name, "--worker=all"] for name in names]
    assert 'kill -- -"$(cat "$f")"' in stop[0][-1]
    assert dry("ssh", pod).commands == [GCLOUD + ["tpu-vm", "ssh", "dora-qwen7b-dapo-trainer", "--worker=0", *where]]
    assert dry("ssh", pod, node="dora-qwen7b-dapo-rollout-2", worker="all", command="uptime").commands == [
        GCLOUD + ["tpu-vm", "ssh", "dora-qwen7b-dapo-rollout-2", "--worker=all", *where, "--command=uptime"]
    ]
    assert dry("status", pod).commands == [GCLOUD + ["tpu-vm", "describe", name, *where] for name in names]
    assert dry("delete", pod).commands == [
        GCLOUD + ["tpu-vm", "delete", name, "--quiet", "--async", *where] for name in names
    ] + [firewall_delete("dora-qwen7b-dapo")]
    with pytest.raises(ValueError, match="no node 'nope'"):
        dry("ssh", pod, node="nope")


# Refusals, before any gcloud call: each names the field.


def _refuse(config, *fields):
    with pytest.raises(ValueError) as error:
        pod_lib.from_config(config)
    for field in fields:
        assert field in str(error.value), (field, str(error.value))
    return str(error.value)


def test_refuses_unknown_accelerator_types():
    c = gsm8k_config()
    c.pod.trainer_type = "v5e-8"
    assert "v5litepod-8" in _refuse(c, "pod.trainer_type", "launch/tpu_types.py")
    c = dapo_config()
    c.pod.rollout_type = "v5p-12"
    _refuse(c, "pod.rollout_type", "v5p sizes")


def test_refuses_a_zone_that_does_not_offer_the_type():
    c = dapo_config()
    c.pod.zone = "us-west4-a"
    _refuse(c, "pod.zone", "pod.trainer_type", "us-east5-a")
    c = dapo_config()
    c.pod.rollout_type = "v5litepod-4"  # v5e: not offered in us-east5-a
    with c.unlocked():
        c.mesh.rollout = ml_collections.ConfigDict({"tensor": 4})
    _refuse(c, "pod.zone", "pod.rollout_type")


def test_refuses_layouts_that_do_not_fit():
    c = gsm8k_config()
    c.pod.trainer_type = "v5litepod-16"
    _refuse(c, "pod.layout", "pod.trainer_type", "4 hosts")
    c = gsm8k_config()
    c.mesh.trainer.fsdp = 8
    _refuse(c, "mesh.trainer", "rollout.num_slices", "mesh.rollout", "12 chips")
    c = gsm8k_config()
    c.pod.rollout_type = "v5litepod-8"
    _refuse(c, "pod.rollout_type")
    c = dapo_config()
    c.mesh.trainer.fsdp = 8
    _refuse(c, "mesh.trainer", "pod.trainer_type", "16")
    c = dapo_config()
    c.mesh.rollout.tensor = 8
    _refuse(c, "mesh.rollout", "pod.rollout_type")
    c = dapo_config()
    c.rollout.num_slices = 0
    _refuse(c, "rollout.num_slices")
    c = dapo_config()
    c.mesh.time_shared = True
    _refuse(c, "mesh.time_shared")


def test_refuses_multislice_misconfigurations():
    c = multislice_config()
    c.pod.queued = False
    _refuse(c, "pod.layout", "pod.queued")
    c = multislice_config()
    c.pod.rollout_type = "v5p-16"
    _refuse(c, "pod.rollout_type", "pod.trainer_type")


def test_refuses_bad_pod_fields():
    for field, value, names in [
        ("layout", "ring", ("pod.layout", "single_host")),
        ("provisioning", "cheap", ("pod.provisioning", "spot")),
        ("name", "Dora_Run", ("pod.name",)),
        ("project", "", ("pod.project",)),
        ("workdir", "/tmp/run", ("pod.workdir", "gs://")),
        ("stage_model_from", "/data/model", ("pod.stage_model_from",)),
        ("port", 0, ("pod.port",)),
        ("python", "python3", ("pod.python", "3.11", "3.10")),  # the old field: an interpreter name
        ("python", "3.10", ("pod.python", "3.11")),  # what the images ship: too old for jax 0.10
    ]:
        c = dapo_config()
        c.pod[field] = value
        _refuse(c, *names)
    c = dapo_config()
    c.pod.provisioning = "preemptible"
    _refuse(c, "pod.provisioning", "pod.queued")
    c = dapo_config()
    c.pod.queued = False
    c.pod.provisioning = "reserved"
    _refuse(c, "pod.provisioning", "pod.queued")
    c = dapo_config()
    c.pod.name = "a-very-long-pod-name-that-is-almost-too-long"
    _refuse(c, "pod.name")
    c = dapo_config()
    with c.unlocked():
        del c.pod["jax_tpu"]
    _refuse(c, "pod.jax_tpu")
    with c.unlocked():
        del c["pod"]
    _refuse(c, "pod")


def test_placeholders_refused_unless_dry_run():
    c = load("qwen2_5_7b_dapo.py")
    assert pod_lib.placeholders(c) == [
        "pod.project",
        "pod.service_account",
        "pod.stage_model_from",
        "pod.workdir",
        "task.source.path",
    ]
    with pytest.raises(ValueError, match="pod.project, pod.service_account, pod.stage_model_from, pod.workdir"):
        tpu.check_placeholders(c, "create", tpu.Shell(dry_run=False, out=io.StringIO()))
    tpu.check_placeholders(c, "delete", tpu.Shell(dry_run=False, out=io.StringIO()))  # nothing to pay for
    shell = tpu.Shell(dry_run=True, out=io.StringIO())
    tpu.check_placeholders(c, "create", shell)
    assert "warning" in shell.out.getvalue()


def test_config_outside_the_tree_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--config="):
        tpu.remote_config_path(str(tmp_path / "x.py"))
    assert tpu.remote_config_path(str(ROOT / "configs" / "smoke.py")) == "configs/smoke.py"
    assert tpu.config_overrides(["tpu.py", "run", "--config=c.py", "--config.a.b=1", "--dry_run"]) == ["--config.a.b=1"]


def test_tpu_type_table():
    assert [
        (t.chips, t.hosts)
        for t in map(
            lambda n: tpu_types.lookup(n, "f"),
            ["v5litepod-8", "v5litepod-16", "v5p-8", "v5p-64", "v6e-8", "v6e-256", "v4-32"],
        )
    ] == [(8, 1), (16, 4), (4, 1), (32, 8), (8, 1), (256, 64), (16, 4)]
    assert "v5litepod-8" in tpu_types.known_types()


# The real shell and the packing step (these run local programs, not gcloud).


def test_shell_runs_and_captures(monkeypatch):
    monkeypatch.undo()  # allow subprocess.run here
    shell = tpu.Shell(dry_run=False, out=io.StringIO())
    assert shell.capture([sys.executable, "-c", "print(' 10.1.2.3 ')"], "unused") == "10.1.2.3"
    shell.run([sys.executable, "-c", "pass"])
    with pytest.raises(subprocess.CalledProcessError):
        shell.run([sys.executable, "-c", "raise SystemExit(3)"])


def test_pack_takes_the_tree_git_sees(monkeypatch, tmp_path):
    monkeypatch.undo()
    import tarfile

    archive = tmp_path / "src.tar.gz"
    tpu.pack(ROOT, str(archive), tpu.Shell(dry_run=False, out=io.StringIO()))
    names = set(tarfile.open(archive).getnames())
    assert {"pyproject.toml", "launch/tpu.py", "configs/qwen2_5_7b_dapo.py"} <= names
    assert not any(n.startswith(".git/") or "__pycache__" in n for n in names)


@pytest.mark.slow
def test_command_line_dry_run(monkeypatch):
    monkeypatch.undo()
    out = subprocess.run(
        [
            sys.executable,
            "launch/tpu.py",
            "create",
            "--config=configs/qwen2_5_7b_dapo.py",
            "--dry-run",
            "--nocheck_run_config",
            "--config.pod.project=p1",
            "--config.rollout.num_slices=2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    # the run's firewall rule, then one queued resource
    rule, line = [line for line in out.stdout.splitlines() if not line.startswith("#")]
    assert rule.startswith("gcloud compute firewall-rules create dora-qwen7b-dapo-dora-ports --project=p1")
    body = json.loads(shlex.split(shlex.split(line)[2])[10])
    assert [spec["nodeId"] for spec in body["tpu"]["nodeSpec"]] == [
        "dora-qwen7b-dapo-trainer",
        "dora-qwen7b-dapo-rollout-0",
        "dora-qwen7b-dapo-rollout-1",
    ]
    bad = subprocess.run(
        [
            sys.executable,
            "launch/tpu.py",
            "create",
            "--config=configs/qwen2_5_7b_dapo.py",
            "--dry-run",
            "--nocheck_run_config",
            "--config.pod.trainer_type=v5p-48",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "pod.trainer_type='v5p-48'" in bad.stderr


# `run` waits for the end and reports each role.


def test_start_and_roles_scripts_report_exit_status_running_and_gone(monkeypatch, tmp_path):
    """The real start script and roles script under bash, with the pod's directories in tmp_path:
    a role that exits 0, one that fails with 3, one still running and one killed by SIGKILL."""
    monkeypatch.undo()

    monkeypatch.setattr(commands, "SRC_DIR", str(tmp_path / "src"))
    monkeypatch.setattr(commands, "LOG_DIR", str(tmp_path / "logs"))
    (tmp_path / "src").mkdir()
    roles = {"ok": "exit 0", "bad": "exit 3", "busy": "sleep 60", "killed": "sleep 60"}
    for name, code in roles.items():
        process = commands.Process(None, "all", Role.TRAINER, name, (("DORA_ROLE", "trainer"),), ("sh", "-c", code))
        subprocess.run(["bash", "-c", commands.start_script(process)], check=True, timeout=10)
    pgid = int((tmp_path / "logs" / "killed.pid").read_text())
    deadline = time.monotonic() + 10
    while not ((tmp_path / "logs" / "ok.exit").exists() and (tmp_path / "logs" / "bad.exit").exists()):
        assert time.monotonic() < deadline, "the short roles wrote no exit status"
        time.sleep(0.05)
    os.killpg(pgid, signal.SIGKILL)
    time.sleep(0.2)
    try:
        out = subprocess.run(["bash", "-c", commands.roles_script()], check=True, capture_output=True, text=True)
        states = {s.name: s for s in commands.parse_roles(out.stdout)}
    finally:
        os.killpg(int((tmp_path / "logs" / "busy.pid").read_text()), signal.SIGKILL)
    assert {n: (s.state, s.code) for n, s in states.items()} == {
        "ok": ("exit", 0),
        "bad": ("exit", 3),
        "busy": ("running", None),
        "killed": ("gone", None),
    }
    assert [n for n, s in states.items() if s.failed] == sorted(["bad", "killed"], key=list(states).index)
    # a new start of a role removes its previous exit status
    again = commands.Process(None, "all", Role.TRAINER, "bad", (), ("sleep", "60"))
    subprocess.run(["bash", "-c", commands.start_script(again)], check=True, timeout=10)
    out = subprocess.run(["bash", "-c", commands.roles_script()], check=True, capture_output=True, text=True)
    os.killpg(int((tmp_path / "logs" / "bad.pid").read_text()), signal.SIGKILL)
    assert [str(s).split(": ")[1] for s in commands.parse_roles(out.stdout) if s.name == "bad"] == ["running"]


class _PodShell(tpu.Shell):
    """Answers each poll of the pod's nodes from a script of outputs (no gcloud here)."""

    def __init__(self, polls):
        super().__init__(dry_run=False, out=io.StringIO())
        self.polls = list(polls)

    def capture(self, argv, dry_run_value):
        self.commands.append(list(argv))
        answer = self.polls.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_wait_polls_until_every_role_exits_and_reports_failures():
    c = dapo_config()
    c.rollout.num_slices = 1
    pod = pod_lib.from_config(c)
    assert len(pod.nodes) == 2  # trainer, rollout-0
    trainer_running = "role t-w0 coordinator running\nrole t-w0 trainer running\nrole t-w1 trainer running\n"
    trainer_done = (
        "Warning: ssh noise\nrole t-w0 coordinator exit 0\nrole t-w0 trainer exit 0\nrole t-w1 trainer exit 0\n"
    )
    rollout_done = "role r-w0 rollout-0 exit 0\n"
    ssh_down = subprocess.CalledProcessError(255, ["gcloud"])
    shell = _PodShell([trainer_running, "role r-w0 rollout-0 running\n", ssh_down, trainer_done, rollout_done])
    sleeps = []
    states = tpu.wait_for_end(pod, shell, poll_s=5, sleep=sleeps.append)
    assert sleeps == [5, 5]  # three polls, one of them failed
    assert [str(s) for s in states] == [
        "coordinator on t-w0: exit 0",
        "trainer on t-w0: exit 0",
        "trainer on t-w1: exit 0",
        "rollout-0 on r-w0: exit 0",
    ]
    notes = shell.out.getvalue()
    assert "# rollout-0 on r-w0: running" in notes and "poll failed" in notes and "the run is over" in notes
    assert all(cmd[6] == "--worker=all" and "ps -o stat=" in cmd[-1] for cmd in shell.commands)
    failing = _PodShell(
        [trainer_done.replace("t-w1 trainer exit 0", "t-w1 trainer exit 1"), "role r-w0 rollout-0 gone\n"]
    )
    with pytest.raises(
        SystemExit, match=r"2 failed role process\(es\): trainer on t-w1: exit 1; rollout-0 on r-w0: gone"
    ):
        tpu.wait_for_end(pod, failing, poll_s=5, sleep=sleeps.append)
    with pytest.raises(SystemExit, match="no role process on the nodes of dora-qwen7b-dapo: was `run` called"):
        tpu.wait_for_end(pod, _PodShell(["", ""]), sleep=sleeps.append)
    with pytest.raises(SystemExit, match="3 polls of the pod failed in a row"):
        tpu.wait_for_end(pod, _PodShell([ssh_down] * 3), max_failed_polls=3, sleep=sleeps.append)


def test_run_then_waits_in_a_dry_run():
    pod = pod_lib.from_config(gsm8k_config())
    shell = dry("run", pod, config_path=str(ROOT / "configs/qwen2_5_0_5b_gsm8k.py"), wait=True, poll_s=30)
    assert len(shell.commands) == 2  # the start, then one poll of the roles on every worker
    assert shell.commands[1][5:7] == ["dora-qwen05-gsm8k", "--worker=all"] and "ps -o stat=" in shell.commands[1][-1]
    assert "then every 30 s the same, until no role runs" in shell.out.getvalue()


# Security: the network, tag, firewall and service account; credentials never on a command line.


def test_create_puts_the_nodes_on_the_runs_network_behind_its_firewall_rule():
    pod = pod_lib.from_config(dapo_config())
    shell = dry("create", pod)
    rule = shell.commands[0]
    assert rule[:4] == ["gcloud", "compute", "firewall-rules", "create"]
    assert "--source-tags=dora-qwen7b-dapo-dora" in rule and "--target-tags=dora-qwen7b-dapo-dora" in rule
    assert "--rules=tcp:8470,tcp:8480-8481,tcp:8476" in rule  # only the run's ports
    printed = shell.out.getvalue()  # one request of mixed types: the TPU API's body
    assert '"enableExternalIps": false' in printed and '"tags": ["dora-qwen7b-dapo-dora"]' in printed
    assert f'"serviceAccount": {{"email": "{SA}"' in printed and '"network": "dora-net"' in printed
    c = dapo_config()
    c.pod.queued_together = False
    nodes = dry("create", pod_lib.from_config(c)).commands[1:]  # gcloud, one request per node
    assert len(nodes) == 5
    for option in ("--network=dora-net", "--internal-ips", "--tags=dora-qwen7b-dapo-dora", f"--service-account={SA}"):
        assert all(option in command for command in nodes), option


def test_a_default_network_or_no_service_account_is_refused():
    c = dapo_config()
    c.pod.network = "default"
    _refuse(c, "pod.network='default'", "default-allow-internal")
    c = dapo_config()
    c.pod.service_account = ""
    _refuse(c, "pod.service_account=''")
    c = dapo_config()
    c.pod.transfer_port = 8469  # its bulk port would be the coordinator's
    _refuse(c, "pod.transfer_port=8469")


@pytest.mark.parametrize("config", [dapo_config, multislice_config], ids=["slices", "multislice"])
def test_run_hands_each_node_only_its_credentials_and_prints_no_secret(config, tmp_path):
    pod = pod_lib.from_config(config())
    shell = dry("run", pod, config_path="configs/qwen2_5_7b_dapo.py", coordinator_ip=IP, credentials_dir=str(tmp_path))
    secret = (tmp_path / "run_secret").read_text()
    tokens = [p.read_text() for p in tmp_path.glob("*.token")]
    key = (tmp_path / "server.key").read_text()
    assert len(secret) == 64 and len(tokens) == len(pod.nodes)
    printed = shell.out.getvalue() + repr(shell.commands)
    for value in (secret, *tokens, key, *(t.split(".")[1] for t in tokens)):
        assert value not in printed
    copied = {
        c[-4].split(":")[0]: {os.path.basename(f) for f in c[5:-4]}
        for c in shell.commands
        if c[3:5] == ["tpu-vm", "scp"]
    }
    trainer, *rollouts = (n.name for n in pod.nodes)
    assert copied[trainer] == {"run_secret", "server.pem", "server.key", "trainer.token", "ca.pem"}
    for i, name in enumerate(rollouts):
        assert copied[name] == {f"rollout-{i}.token", "ca.pem"}  # never the secret or another role's token
