"""The gcloud command lines of each launch action, as argv lists: pure functions of a `Pod`.

On the pod every worker holds the source tree in `~/dora_jax` (every role starts there, so a
relative workdir or checkpoint path is relative to it) and writes its log and pid files to
`~/dora_logs/<process>.{log,pid}`, and `<process>.exit` (its exit status) when it ends. Roles are
started with `setsid nohup` so they outlive the ssh session; `stop` kills each recorded process
group; `roles` prints one line per process of a node's workers: running, its exit status, or gone
(killed without one: SIGKILL, a preempted VM).

Security (docs/security.md): every node joins `pod.network`/`pod.subnetwork` under the run's tag,
with no public IP (`pod.internal_ips`) and `pod.service_account`; for a run of several nodes
`create` first adds a firewall rule that opens the coordinator port, the transfer ports and the
JAX distributed runtime's port between the run's tagged VMs only. `run` copies each node only its
role's credentials (the coordinator's node the run secret, every other node its role token, and
with `pod.tls` the CA, the coordinator's node its certificate and key) into AUTH_DIR (mode 0700,
files 0600) with scp, and names the files in each role's environment: no command line holds a
secret.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from collections.abc import Sequence

from dora_jax.transport import auth
from launch.pod import Layout, Node, Pod, Provisioning, Role

SRC_DIR = "~/dora_jax"  # the source tree on every worker
VENV_PYTHON = ".venv/bin/python"  # the environment `setup` makes in SRC_DIR; every role runs from it
UV = "~/.local/bin/uv"  # where `pip install --user uv` puts uv
ARCHIVE = "~/dora_jax_src.tar.gz"  # what `setup` copies there
LOG_DIR = "~/dora_logs"
AUTH_DIR = "~/dora_auth"  # a role's credentials on a worker (0700)
AUTH_FROM_SRC = "../dora_auth"  # the same, as the role processes (started in SRC_DIR) name it
SCOPES = "--scopes=https://www.googleapis.com/auth/cloud-platform"  # access is the service account's IAM roles
JAX_DISTRIBUTED_PORT = 8476  # jax.distributed's coordination service inside a multi-host slice (Cloud TPU)
JAX_TPU_FIND_LINKS = "https://storage.googleapis.com/jax-releases/libtpu_releases.html"
IP_FORMAT = "--format=value(networkEndpoints[0].ipAddress)"  # worker 0's internal IP

# A multislice queued resource puts MEGASCALE_* values into every worker's TPU metadata, and
# jax.distributed.initialize() would then join all slices into ONE JAX job. Here each slice is its
# own job (versions travel through the ParamStore, not DCN collectives): environment variables win
# over the metadata, so each process is told it is alone in a one-slice job.
SINGLE_SLICE_ENV = (("MEGASCALE_COORDINATOR_ADDRESS", ""), ("MEGASCALE_NUM_SLICES", "1"), ("MEGASCALE_SLICE_ID", "0"))

ROLE_MODULES = {
    Role.EMBEDDED: "dora_jax.train",
    Role.COORDINATOR: "dora_jax.serve_coordinator",
    Role.TRAINER: "dora_jax.trainer_worker",
    Role.ROLLOUT: "dora_jax.rollout_worker",
}


def gcloud(pod: Pod, *args: str) -> list[str]:
    """`gcloud compute tpus ARGS --zone=ZONE --project=PROJECT`."""
    return ["gcloud", "compute", "tpus", *args, f"--zone={pod.zone}", f"--project={pod.project}"]


def _provisioning_flags(pod: Pod) -> list[str]:
    flags = {
        Provisioning.ON_DEMAND: [],
        Provisioning.SPOT: ["--spot"],
        Provisioning.PREEMPTIBLE: ["--preemptible"],
        Provisioning.RESERVED: ["--reserved"],
    }
    return flags[pod.provisioning]


def _network_flags(pod: Pod) -> list[str]:
    """Where a node lives and as whom: the run's network, its tag, no public IP, its service account."""
    flags = [f"--network={pod.network}"] + ([f"--subnetwork={pod.subnetwork}"] if pod.subnetwork else [])
    flags += ["--internal-ips"] if pod.internal_ips else []
    return flags + [f"--tags={pod.tag}", f"--service-account={pod.service_account}", SCOPES]


def firewall_rule(pod: Pod) -> str:
    return f"{pod.name}-dora-ports"


def firewall_create(pod: Pod) -> list[str]:
    """Opens the run's ports (coordinator, transfer servers, jax.distributed) between its tagged VMs only."""
    ports = f"tcp:{pod.port},tcp:{pod.transfer_port}-{pod.transfer_port + 1},tcp:{JAX_DISTRIBUTED_PORT}"
    return [
        "gcloud",
        "compute",
        "firewall-rules",
        "create",
        firewall_rule(pod),
        f"--project={pod.project}",
        f"--network={pod.network}",
        "--direction=INGRESS",
        "--action=ALLOW",
        f"--rules={ports}",
        f"--source-tags={pod.tag}",
        f"--target-tags={pod.tag}",
        f"--description=dora_jax run {pod.name}: coordinator, transfer and jax.distributed ports between its VMs",
    ]


def create(pod: Pod) -> list[list[str]]:
    """The firewall rule (several nodes), then one `queued-resources create` per request (a POST to
    the TPU API for a request of mixed types), or one `tpu-vm create` per node."""
    commands = [] if pod.layout is Layout.SINGLE_HOST else [firewall_create(pod)]
    if not pod.queued:
        return commands + [
            gcloud(
                pod,
                "tpu-vm",
                "create",
                node.name,
                f"--accelerator-type={node.tpu.name}",
                f"--version={node.runtime_version}",
            )
            + _provisioning_flags(pod)
            + _network_flags(pod)
            for node in pod.nodes
        ]
    for request in pod.requests:
        if request.node_specs:
            commands.append(_create_node_specs(pod, request))
            continue
        first = request.nodes[0]
        if request.multislice:
            nodes = [f"--node-count={len(request.nodes)}", f"--node-prefix={request.name}"]
        else:
            nodes = [f"--node-id={first.name}"]
        commands.append(
            gcloud(
                pod,
                "queued-resources",
                "create",
                request.name,
                f"--accelerator-type={first.tpu.name}",
                f"--runtime-version={first.runtime_version}",
                *nodes,
            )
            + _provisioning_flags(pod)
            + _network_flags(pod)
        )
    return commands


TPU_API = "https://tpu.googleapis.com/v2"


def node_specs_body(pod: Pod, request) -> dict:
    """The TPU API's QueuedResource for nodes of several types: one nodeSpec per node."""
    parent = f"projects/{pod.project}/locations/{pod.zone}"
    body: dict = {
        "tpu": {
            "nodeSpec": [
                {
                    "parent": parent,
                    "nodeId": node.name,
                    "node": {
                        "acceleratorType": node.tpu.name,
                        "runtimeVersion": node.runtime_version,
                        "networkConfig": {
                            "network": pod.network,
                            **({"subnetwork": pod.subnetwork} if pod.subnetwork else {}),
                            "enableExternalIps": not pod.internal_ips,
                        },
                        "tags": [pod.tag],
                        "serviceAccount": {"email": pod.service_account, "scope": [SCOPES.partition("=")[2]]},
                    },
                }
                for node in request.nodes
            ]
        }
    }
    provisioning = {
        Provisioning.SPOT: {"spot": {}},
        Provisioning.RESERVED: {"guaranteed": {"reserved": True}},
    }
    body.update(provisioning.get(pod.provisioning, {}))
    return body


def _create_node_specs(pod: Pod, request) -> list[str]:
    """gcloud has no flag for a request of mixed types: POST the QueuedResource to the TPU API
    with gcloud's own credentials (the token is read in the shell, never printed)."""
    url = f"{TPU_API}/projects/{pod.project}/locations/{pod.zone}/queuedResources?queuedResourceId={request.name}"
    script = (
        'curl -sS --fail-with-body -X POST -H "Authorization: Bearer $(gcloud auth print-access-token)" '
        f'-H "Content-Type: application/json" -d {shlex.quote(json.dumps(node_specs_body(pod, request)))} '
        f"{shlex.quote(url)}"
    )
    return ["bash", "-c", script]


# A rollout slice of a multi-node layout loads every version from the ParamStore (the trainer
# publishes version 0 from the checkpoint): it needs the checkpoint's config and tokenizer only.
WEIGHT_FILES = r".*\.(safetensors|bin|pt|pth|msgpack|h5)$"


def setup_script(pod: Pod, node: Node | None = None) -> str:
    """What every worker of `node` runs once: unpack the tree, make a Python `pod.python`
    environment with uv (the TPU VM images ship Python 3.10; jax 0.10 needs >= 3.11) unless one of
    that version is there, install jax[tpu] and the package into it, stage the checkpoint (a
    rollout node of a multi-node layout: all but the weights)."""
    version = pod.python
    wanted = f"import sys; sys.exit(sys.version_info[:2] != {tuple(int(n) for n in version.split('.'))})"
    steps = [
        f"mkdir -p {SRC_DIR}",
        f"tar -xzf {ARCHIVE} -C {SRC_DIR}",
        f"cd {SRC_DIR}",
        "python3 -m pip install -q --user --upgrade uv",
        f"{{ {VENV_PYTHON} -c {shlex.quote(wanted)} 2>/dev/null || "
        f"{{ rm -rf .venv && {UV} venv -q --python {version} .venv; }}; }}",
        f"{UV} pip install -q --python {VENV_PYTHON} {shlex.quote(pod.jax_tpu)} -f {JAX_TPU_FIND_LINKS}",
        f"{UV} pip install -q --python {VENV_PYTHON} -e .",
    ]
    if pod.stage_model_from:
        model = shlex.quote(pod.model_path)
        weights = node is not None and node.role is Role.ROLLOUT
        exclude = f" --exclude={shlex.quote(WEIGHT_FILES)}" if weights else ""
        steps += [
            f"mkdir -p {model}",
            f"gcloud storage rsync --recursive{exclude} {shlex.quote(pod.stage_model_from)} {model}",
        ]
    return " && ".join(steps)


def setup(pod: Pod, archive: str) -> list[list[str]]:
    """Per node: copy the packed tree to every worker, then run `setup_script` on every worker."""
    commands = []
    for node in pod.nodes:
        commands.append(gcloud(pod, "tpu-vm", "scp", archive, f"{node.name}:{ARCHIVE}", "--worker=all"))
        commands.append(ssh(pod, node, "all", setup_script(pod, node)))
    return commands


def ssh(pod: Pod, node: Node, worker: str, command: str | None = None) -> list[str]:
    argv = gcloud(pod, "tpu-vm", "ssh", node.name, f"--worker={worker}")
    return argv + ([f"--command={command}"] if command is not None else [])


def coordinator_ip(pod: Pod) -> list[str]:
    """Prints the internal IP of worker 0 of the trainer node (where the coordinator listens)."""
    return gcloud(pod, "tpu-vm", "describe", pod.trainer.name, IP_FORMAT)


@dataclasses.dataclass(frozen=True)
class Process:
    """One role started on one worker ("0") or on every worker ("all") of a node."""

    node: Node
    worker: str
    role: Role
    name: str  # log/pid file stem under LOG_DIR
    env: tuple[tuple[str, str], ...]
    argv: tuple[str, ...]


def processes(pod: Pod, config_path: str, overrides: Sequence[str], coordinator_host: str) -> list[Process]:
    """Every role process of the run, in start order: coordinator, trainer, rollout slices."""
    common = (f"--config={config_path}", f"--workdir={pod.workdir}")

    def argv(role: Role, *extra: str) -> tuple[str, ...]:
        return (VENV_PYTHON, "-m", ROLE_MODULES[role], *common, *extra, *overrides)

    if pod.layout is Layout.SINGLE_HOST:
        return [
            Process(pod.trainer, "all", Role.EMBEDDED, "embedded", (("DORA_ROLE", "embedded"),), argv(Role.EMBEDDED))
        ]
    address = f"{coordinator_host}:{pod.port}"
    extra_env = SINGLE_SLICE_ENV if pod.layout is Layout.MULTISLICE else ()

    def env(role: Role, *more: tuple[str, str]) -> tuple[tuple[str, str], ...]:
        return (("DORA_ROLE", role.value), ("DORA_COORDINATOR", address), *more, *extra_env)

    def secured(role: Role, node: Node) -> tuple[tuple[str, str], ...]:
        """`env` plus the variables naming the role's credential files (paths, never contents)."""
        principal = None if role is Role.COORDINATOR else _principal(node)
        files = {key: f"{AUTH_FROM_SRC}/{name}" for key, name in _credential_env(pod, principal).items()}
        more = (("DORA_SLICE_ID", str(node.slice_id)),) if role is Role.ROLLOUT else ()
        return env(role, *more) + tuple(files.items())

    transfer = f"--transfer_port={pod.transfer_port}"

    result = [
        Process(
            pod.trainer,
            "0",
            Role.COORDINATOR,
            "coordinator",
            secured(Role.COORDINATOR, pod.trainer),
            argv(Role.COORDINATOR, f"--port={pod.port}", f"--host={coordinator_host}"),
        ),
        Process(
            pod.trainer,
            "all",
            Role.TRAINER,
            "trainer",
            secured(Role.TRAINER, pod.trainer),
            argv(Role.TRAINER, f"--coordinator={address}", transfer, *_hosts(pod.trainer)),
        ),
    ]
    for node in pod.rollout_nodes:
        result.append(
            Process(
                node,
                "all",
                Role.ROLLOUT,
                f"rollout-{node.slice_id}",
                secured(Role.ROLLOUT, node),
                argv(Role.ROLLOUT, f"--coordinator={address}", f"--slice_id={node.slice_id}", transfer, *_hosts(node)),
            )
        )
    return result


def _principal(node: Node) -> auth.Principal:
    return auth.TRAINER if node.role is Role.TRAINER else auth.rollout(node.slice_id)


def _credential_env(pod: Pod, principal: auth.Principal | None) -> dict[str, str]:
    """Variable -> file name (in AUTH_DIR) of one role: the coordinator's (None) or a client's."""
    if principal is None:
        names = {auth.SECRET_FILE_ENV: "run_secret"}
        if pod.tls:
            names.update({auth.CERT_FILE_ENV: "server.pem", auth.KEY_FILE_ENV: "server.key"})
        return names
    names = {auth.TOKEN_FILE_ENV: f"{principal.name}.token"}
    return names | ({auth.CA_FILE_ENV: "ca.pem"} if pod.tls else {})


def credentials(pod: Pod, made: auth.RunCredentials) -> list[list[str]]:
    """Per node of a multi-node layout: a fresh AUTH_DIR (0700) on every worker, then scp of the
    files its roles read (their modes, 0600, travel with them): the coordinator's node the secret
    (and the certificate and key), each node its role's token (and the CA)."""
    local = {
        "run_secret": made.secret_file,
        **{os.path.basename(path): path for path in made.token_files.values()},
        **{os.path.basename(path): path for path in (made.tls or {}).values()},
    }
    commands = []
    for node in pod.nodes:
        wanted = _credential_env(pod, _principal(node))
        if node is pod.trainer:
            wanted |= _credential_env(pod, None)
        files = [local[name] for name in sorted(set(wanted.values()))]
        commands.append(ssh(pod, node, "all", f"rm -rf {AUTH_DIR} && mkdir -m 700 {AUTH_DIR}"))
        commands.append(gcloud(pod, "tpu-vm", "scp", *files, f"{node.name}:{AUTH_DIR}/", "--worker=all"))
    return commands


def _hosts(node: Node) -> tuple[str, ...]:
    """A node of several hosts is one multi-controller JAX job: `--num_hosts`; each worker's
    --host_id and the job's jax.distributed coordinator are auto-detected from the TPU metadata."""
    return (f"--num_hosts={node.tpu.hosts}",) if node.tpu.hosts > 1 else ()


def start_script(process: Process) -> str:
    """Starts `process` detached, its output in LOG_DIR/<name>.log, its process group id in .pid,
    its exit status in .exit when it ends (an earlier run's is removed first). The .pid file is
    written once the process leads its own session (setsid has run, for at most 5 s), so a `stop`
    right after the start finds the group it kills."""
    env = " ".join(f"{key}={shlex.quote(value)}" for key, value in process.env)
    log, pid, code = (f"{LOG_DIR}/{process.name}.{ext}" for ext in ("log", "pid", "exit"))
    command = shlex.quote(f"{shlex.join(process.argv)}; echo $? > {code}")
    return (
        f"cd {SRC_DIR} && mkdir -p {LOG_DIR} && rm -f {code} && "
        f"{{ {env} setsid nohup sh -c {command} > {log} 2>&1 < /dev/null & p=$!; {SESSION_WAIT} echo $p > {pid}; }}"
    )


# Waits until the background process $p leads its session, has ended, or 500 x 10 ms pass.
SESSION_WAIT = (
    'i=0; while [ "$(ps -o sid= -p $p 2>/dev/null | tr -d \' \')" != "$p" ] && kill -0 $p 2>/dev/null '
    "&& [ $i -lt 500 ]; do sleep 0.01; i=$((i+1)); done;"
)


def roles_script() -> str:
    """Prints `role HOST NAME running|exit CODE|gone` for each process started on this worker."""
    return (
        f'for f in {LOG_DIR}/*.pid; do [ -e "$f" ] || continue; n=$(basename "$f" .pid); '
        f'if [ -e {LOG_DIR}/"$n".exit ]; then echo "role $(hostname) $n exit $(cat {LOG_DIR}/"$n".exit)"; '
        f'else case "$(ps -o stat= -p "$(cat "$f")" 2>/dev/null)" in ""|Z*) s=gone;; *) s=running;; esac; '
        f'echo "role $(hostname) $n $s"; fi; done; true'
    )  # a zombie (killed, its parent not yet reaping) counts as gone


@dataclasses.dataclass(frozen=True)
class RoleState:
    host: str
    name: str  # the process's name: embedded, coordinator, trainer, rollout-N
    state: str  # "running" | "exit" | "gone"
    code: int | None = None  # the exit status

    @property
    def failed(self) -> bool:
        return self.state == "gone" or (self.state == "exit" and self.code != 0)

    def __str__(self) -> str:
        what = f"exit {self.code}" if self.state == "exit" else self.state
        return f"{self.name} on {self.host}: {what}"


def roles(pod: Pod) -> list[list[str]]:
    """Each node's role processes, one `role HOST NAME STATE [CODE]` line per process and worker."""
    return [ssh(pod, node, "all", roles_script()) for node in pod.nodes]


def parse_roles(text: str) -> list[RoleState]:
    """The `role ...` lines of `roles`' output (ssh may interleave other lines: skipped)."""
    states = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4 or parts[0] != "role" or parts[3] not in ("running", "exit", "gone"):
            continue
        code = None
        if parts[3] == "exit":
            try:
                code = int(parts[4])
            except (IndexError, ValueError):
                code = -1  # an unreadable status file: counted as a failure
        states.append(RoleState(parts[1], parts[2], parts[3], code))
    return states


def run(pod: Pod, config_path: str, overrides: Sequence[str], coordinator_host: str) -> list[list[str]]:
    return [
        ssh(pod, p.node, p.worker, start_script(p)) for p in processes(pod, config_path, overrides, coordinator_host)
    ]


def logs(pod: Pod, lines: int) -> list[list[str]]:
    script = f'for f in {LOG_DIR}/*.log; do echo "== $(hostname) $f"; tail -n {int(lines)} "$f"; done'
    return [ssh(pod, node, "all", script) for node in pod.nodes]


def stop(pod: Pod) -> list[list[str]]:
    script = f'for f in {LOG_DIR}/*.pid; do [ -e "$f" ] && kill -- -"$(cat "$f")" 2>/dev/null; rm -f "$f"; done; true'
    return [ssh(pod, node, "all", script) for node in pod.nodes]


def status(pod: Pod) -> list[list[str]]:
    if pod.queued:
        return [gcloud(pod, "queued-resources", "describe", request.name) for request in pod.requests]
    return [gcloud(pod, "tpu-vm", "describe", node.name) for node in pod.nodes]


def delete(pod: Pod) -> list[list[str]]:
    """Queued resources with --force (their nodes go too), else the TPU VMs; asynchronously; then
    the run's firewall rule."""
    if pod.queued:
        commands = [
            gcloud(pod, "queued-resources", "delete", request.name, "--force", "--quiet", "--async")
            for request in pod.requests
        ]
    else:
        commands = [gcloud(pod, "tpu-vm", "delete", node.name, "--quiet", "--async") for node in pod.nodes]
    if pod.layout is not Layout.SINGLE_HOST:
        commands.append(
            ["gcloud", "compute", "firewall-rules", "delete", firewall_rule(pod), f"--project={pod.project}", "--quiet"]
        )
    return commands
