"""The experiment config's `pod` section, validated into a `Pod`: which TPU nodes to create, what
role each one plays, and how the run reaches them.

Layouts (`pod.layout`):
  single_host  one TPU VM (e.g. `v5litepod-8`) runs the whole system in one process
               (`dora_jax.train`); its chips are split by `mesh.trainer`, `mesh.rollout` and
               `rollout.num_slices` as on a laptop. Node: NAME.
  slices       one trainer node (`pod.trainer_type`) and `rollout.num_slices` rollout nodes
               (`pod.rollout_type`), each its own TPU VM and its own JAX job; queued, all of them
               come from ONE queued resource NAME (all or nothing: the trainer is never billed
               while rollout capacity queues) unless `pod.queued_together=False` (one each).
               Nodes: NAME-trainer, NAME-rollout-0, NAME-rollout-1, ...
  multislice   1 + `rollout.num_slices` identical slices from ONE queued resource
               (`--node-count`, `--node-prefix`): all arrive together or not at all. Nodes:
               NAME-0 (trainer), NAME-1 ... NAME-R (rollout slices 0 ... R-1).
The coordinator always runs on worker 0 of the trainer node. Every check raises ValueError naming
the config field, before any gcloud call.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections.abc import Mapping

import ml_collections

from launch import tpu_types
from launch.tpu_types import TpuType


class Layout(enum.Enum):
    SINGLE_HOST = "single_host"
    SLICES = "slices"
    MULTISLICE = "multislice"


class Role(enum.Enum):
    EMBEDDED = "embedded"  # the whole system in one process: python -m dora_jax.train
    COORDINATOR = "coordinator"  # worker 0 of the trainer node: python -m dora_jax.serve_coordinator
    TRAINER = "trainer"  # every worker of the trainer node: python -m dora_jax.trainer_worker
    ROLLOUT = "rollout"  # every worker of one rollout node: python -m dora_jax.rollout_worker


class Provisioning(enum.Enum):
    ON_DEMAND = "on_demand"
    SPOT = "spot"  # may be preempted at any time; much cheaper
    PREEMPTIBLE = "preemptible"  # the older preemptible TPU VMs (plain `tpu-vm create` only)
    RESERVED = "reserved"  # from the project's reservation (queued resources only)


@dataclasses.dataclass(frozen=True)
class Node:
    """One TPU VM (one slice: `tpu.hosts` workers). A TRAINER node also hosts the coordinator."""

    name: str
    tpu: TpuType
    role: Role  # EMBEDDED, TRAINER or ROLLOUT
    slice_id: int | None  # rollout slice index (ROLLOUT nodes only)
    runtime_version: str


@dataclasses.dataclass(frozen=True)
class Request:
    """What one queued resource asks for: one node (`--node-id`), several identical nodes named
    `<name>-0 ...` (`--node-count`, `--node-prefix`), or nodes of several types, each with its own
    nodeSpec (the TPU API; gcloud takes one accelerator type per request)."""

    name: str
    nodes: tuple[Node, ...]
    node_specs: bool = False  # nodes of different types in one request: the TPU API's nodeSpec list

    @property
    def multislice(self) -> bool:
        return len(self.nodes) > 1 and not self.node_specs


@dataclasses.dataclass(frozen=True)
class Pod:
    name: str
    project: str
    zone: str
    layout: Layout
    provisioning: Provisioning
    queued: bool
    nodes: tuple[Node, ...]  # the trainer (or the single host) first, then rollout slices in order
    requests: tuple[Request, ...]  # queued resources (empty when pod.queued is False)
    workdir: str
    port: int
    python: str  # the Python version of the worker environment (`uv venv --python`), e.g. "3.12"
    jax_tpu: str
    stage_model_from: str  # "" or a gs:// directory copied to `model_path` on every worker
    model_path: str
    network: str  # the VPC network the nodes join (never "default")
    subnetwork: str  # "" : the network's subnetwork of the zone's region (auto-mode networks only)
    internal_ips: bool  # no public IP on any node
    service_account: str  # the nodes' service account (docs/security.md: its least privileges)
    tls: bool  # the coordinator speaks TLS with a per-run CA
    transfer_port: int  # transfer servers' control port; the bulk port is the next one

    @property
    def tag(self) -> str:
        """The network tag of the run's VMs: the firewall rule opens the run's ports between them only."""
        return f"{self.name}-dora"

    @property
    def trainer(self) -> Node:
        return self.nodes[0]

    @property
    def rollout_nodes(self) -> tuple[Node, ...]:
        return self.nodes[1:]

    def node(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        raise ValueError(f"no node {name!r} in pod {self.name!r}; nodes: {', '.join(n.name for n in self.nodes)}")


# TPU node and queued-resource ids: lower-case letters, digits and hyphens, starting with a letter.
_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,40}[a-z0-9])?$")
POD_FIELDS = (
    "name",
    "project",
    "zone",
    "layout",
    "trainer_type",
    "rollout_type",
    "runtime_version",
    "provisioning",
    "queued",
    "queued_together",
    "workdir",
    "port",
    "python",
    "jax_tpu",
    "stage_model_from",
    "network",
    "subnetwork",
    "internal_ips",
    "service_account",
    "tls",
    "transfer_port",
)
PLACEHOLDER = "YOUR_"  # configs mark values the user must set with this, e.g. gs://YOUR_BUCKET/...


def _enum(kind, value: str, field: str):
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{field}={value!r}; expected one of {[k.value for k in kind]}") from None


def _mesh_chips(shape: Mapping[str, int]) -> int:
    return math.prod(int(v) for v in dict(shape).values())


def from_config(c: ml_collections.ConfigDict, *, workdir: str = "") -> Pod:
    """Reads and validates `c.pod` against the rest of the config. `workdir` overrides pod.workdir."""
    if "pod" not in c:
        raise ValueError("the config has no `pod` section; see configs/qwen2_5_0_5b_gsm8k.py for one")
    p = c.pod
    missing = [f for f in POD_FIELDS if f not in p]
    if missing:
        raise ValueError(
            f"the pod section lacks {', '.join('pod.' + f for f in missing)}; a pod section has "
            f"{', '.join(POD_FIELDS)} (see configs/qwen2_5_7b_dapo.py)"
        )
    if not _NAME.match(p.name):
        raise ValueError(
            f"pod.name={p.name!r}; expected lower-case letters, digits and hyphens, starting with a "
            "letter, at most 42 characters"
        )
    if not p.project:
        raise ValueError("pod.project is empty; set the GCP project id")
    layout = _enum(Layout, p.layout, "pod.layout")
    provisioning = _enum(Provisioning, p.provisioning, "pod.provisioning")
    queued = bool(p.queued)
    if provisioning is Provisioning.PREEMPTIBLE and queued:
        raise ValueError("pod.provisioning='preemptible' needs pod.queued=False (queued resources offer spot instead)")
    if provisioning is Provisioning.RESERVED and not queued:
        raise ValueError("pod.provisioning='reserved' needs pod.queued=True")
    if not 0 < int(p.port) < 65536:
        raise ValueError(f"pod.port={p.port}; expected 1-65535")
    _check_network(p)

    trainer_type = tpu_types.lookup(p.trainer_type, "pod.trainer_type")
    tpu_types.check_zone(trainer_type, p.zone, "pod.trainer_type", "pod.zone")
    num_slices = int(c.rollout.num_slices)
    if num_slices < 1:
        raise ValueError(f"rollout.num_slices={num_slices}; expected >= 1")

    def runtime(tpu: TpuType) -> str:
        return p.runtime_version or tpu.runtime_version

    if layout is Layout.SINGLE_HOST:
        nodes = _single_host(c, p, trainer_type, runtime(trainer_type))
    else:
        nodes = _slices(c, p, layout, trainer_type, num_slices, queued, runtime)

    together = bool(p.queued_together)
    if together and layout is Layout.SLICES and not queued:
        raise ValueError(
            "pod.queued_together=True asks for every node from one queued resource but pod.queued=False; "
            "set pod.queued=True, or pod.queued_together=False for one TPU VM per node"
        )
    if layout is Layout.MULTISLICE:
        requests = (Request(p.name, nodes),)
    elif queued and together and layout is Layout.SLICES:
        requests = (Request(p.name, nodes, node_specs=True),)
    elif queued:
        requests = tuple(Request(node.name, (node,)) for node in nodes)
    else:
        requests = ()

    workdir = workdir or p.workdir
    if not workdir:
        raise ValueError("pod.workdir is empty; set it (a gs:// path for multi-node layouts) or pass --workdir")
    if layout is not Layout.SINGLE_HOST and not workdir.startswith("gs://"):
        raise ValueError(
            f"pod.workdir={workdir!r}: pod.layout={layout.value!r} runs on several nodes, which share "
            "the workdir and the param versions; expected a gs:// path"
        )
    if not re.fullmatch(r"3\.(1[1-9]|[2-9]\d)", str(p.python)):
        raise ValueError(
            f"pod.python={p.python!r}; expected the Python version of the environment `setup` makes on every "
            "worker, 3.11 or newer (e.g. '3.12'): jax 0.10, flax 0.12, orbax, tensorstore and numpy 2.4 need "
            ">= 3.11, and the TPU VM images ship 3.10"
        )
    stage = str(p.stage_model_from)
    if stage and not stage.startswith("gs://"):
        raise ValueError(f"pod.stage_model_from={stage!r}; expected '' or a gs:// directory")
    if stage and not c.model.hf_path:
        raise ValueError(
            "pod.stage_model_from is set but model.hf_path is empty; set model.hf_path to where the "
            "checkpoint should land on every worker"
        )
    return Pod(
        name=p.name,
        project=p.project,
        zone=p.zone,
        layout=layout,
        provisioning=provisioning,
        queued=queued,
        nodes=nodes,
        requests=requests,
        workdir=workdir,
        port=int(p.port),
        python=str(p.python),
        jax_tpu=p.jax_tpu,
        stage_model_from=stage,
        model_path=str(c.model.hf_path),
        network=str(p.network),
        subnetwork=str(p.subnetwork),
        internal_ips=bool(p.internal_ips),
        service_account=str(p.service_account),
        tls=bool(p.tls),
        transfer_port=int(p.transfer_port),
    )


def _check_network(p) -> None:
    if not p.network or p.network == "default":
        raise ValueError(
            f"pod.network={p.network!r}: name a VPC network made for the run (docs/security.md); the default "
            "network's default-allow-internal rule opens every port between every VM of the project"
        )
    if not p.service_account or "@" not in p.service_account:
        raise ValueError(
            f"pod.service_account={p.service_account!r}; expected a service account's email (docs/security.md "
            "lists the roles it needs: the bucket and logging)"
        )
    ports = (int(p.port), int(p.transfer_port), int(p.transfer_port) + 1)
    if not 0 < ports[1] < 65535 or len(set(ports)) != 3:
        raise ValueError(
            f"pod.transfer_port={p.transfer_port}; expected 1-65534, its port and the next apart from pod.port={p.port}"
        )


def _single_host(c, p, tpu: TpuType, runtime_version: str) -> tuple[Node, ...]:
    if tpu.hosts != 1:
        raise ValueError(
            f"pod.layout='single_host' needs a one-host accelerator but pod.trainer_type={tpu.name!r} "
            f"has {tpu.hosts} hosts; use pod.layout='slices' or a type of <= "
            f"{tpu.chips_per_host if tpu.hosts > 1 else tpu.chips} chips"
        )
    if p.rollout_type:
        raise ValueError(
            f"pod.rollout_type={p.rollout_type!r} but pod.layout='single_host' has no rollout nodes "
            "(the host's chips are split by mesh.*); set it to ''"
        )
    trainer, rollout = _mesh_chips(c.mesh.trainer), _mesh_chips(c.mesh.rollout)
    needed = trainer + int(c.rollout.num_slices) * rollout
    if needed > tpu.chips and not c.mesh.time_shared:
        raise ValueError(
            f"mesh.trainer ({trainer} chips) + rollout.num_slices ({c.rollout.num_slices}) x mesh.rollout "
            f"({rollout} chips) = {needed} chips but pod.trainer_type={tpu.name!r} has {tpu.chips}"
        )
    return (Node(p.name, tpu, Role.EMBEDDED, None, runtime_version),)


def _slices(c, p, layout: Layout, trainer_type: TpuType, num_slices: int, queued: bool, runtime) -> tuple[Node, ...]:
    if layout is Layout.MULTISLICE:
        if not queued:
            raise ValueError("pod.layout='multislice' is one queued resource with --node-count; set pod.queued=True")
        if p.rollout_type and p.rollout_type != p.trainer_type:
            raise ValueError(
                f"pod.rollout_type={p.rollout_type!r}: pod.layout='multislice' slices are identical, "
                f"so it must be '' or pod.trainer_type={p.trainer_type!r} (or use pod.layout='slices')"
            )
        rollout_type = trainer_type
    else:
        if not p.rollout_type:
            raise ValueError("pod.rollout_type is empty; pod.layout='slices' needs the rollout nodes' accelerator type")
        rollout_type = tpu_types.lookup(p.rollout_type, "pod.rollout_type")
        tpu_types.check_zone(rollout_type, p.zone, "pod.rollout_type", "pod.zone")
    trainer_chips, rollout_chips = _mesh_chips(c.mesh.trainer), _mesh_chips(c.mesh.rollout)
    if trainer_chips != trainer_type.chips:
        raise ValueError(
            f"mesh.trainer={dict(c.mesh.trainer)} spans {trainer_chips} chips but pod.trainer_type="
            f"{trainer_type.name!r} has {trainer_type.chips}; the trainer mesh must cover its slice"
        )
    rollout_field = "pod.trainer_type" if layout is Layout.MULTISLICE else "pod.rollout_type"
    if rollout_chips != rollout_type.chips:
        raise ValueError(
            f"mesh.rollout={dict(c.mesh.rollout)} spans {rollout_chips} chips but {rollout_field}="
            f"{rollout_type.name!r} has {rollout_type.chips}; each rollout mesh must cover its slice"
        )
    if c.mesh.time_shared:
        raise ValueError(
            "mesh.time_shared=True shares one host's devices; it has no meaning for "
            f"pod.layout={layout.value!r}: set it to False"
        )
    if layout is Layout.MULTISLICE:
        names = [f"{p.name}-{i}" for i in range(1 + num_slices)]
    else:
        names = [f"{p.name}-trainer"] + [f"{p.name}-rollout-{i}" for i in range(num_slices)]
    for name in names:
        if not _NAME.match(name):
            raise ValueError(f"pod.name={p.name!r} makes node name {name!r} too long; shorten pod.name")
    trainer = Node(names[0], trainer_type, Role.TRAINER, None, runtime(trainer_type))
    rollouts = tuple(
        Node(names[1 + i], rollout_type, Role.ROLLOUT, i, runtime(rollout_type)) for i in range(num_slices)
    )
    return (trainer,) + rollouts


def placeholders(c: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    """The dotted names (sorted) of string fields that still hold a `YOUR_...` placeholder."""
    found = []
    for key, value in c.items():
        field = f"{prefix}{key}"
        if isinstance(value, ml_collections.ConfigDict):
            found += placeholders(value, field + ".")
        elif isinstance(value, str) and PLACEHOLDER in value:
            found.append(field)
    return sorted(found)
