"""TPU chips and topologies: accelerator types to topology names, libtpu's devices of a slice that is not
here, and the roles' meshes on them (`plan_roles`)."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os

import jax
from jax.sharding import Mesh

from dora_jax.parallel import sharding as sharding_lib
from dora_jax.runtime.run_config import RunConfig

INSTALL = 'pip install -e ".[tpu]"'  # libtpu, pinned to what jax[tpu] pins for the jax version


GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    generation: str
    hbm_bytes: int
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes_per_s: float


# Per chip, from the Cloud TPU system architecture pages (cloud.google.com/tpu/docs/v4, /v5e,
# /v5p, /v6e; read 2026-11): HBM capacity, peak bf16 FLOP/s, HBM bandwidth.
CHIPS = {
    "v4": Chip("v4", 32 * GiB, 275e12, 1228e9),
    "v5e": Chip("v5e", 16 * GiB, 197e12, 819e9),
    "v5p": Chip("v5p", 95 * GiB, 459e12, 2765e9),
    "v6e": Chip("v6e", 32 * GiB, 918e12, 1640e9),
}


# Accelerator type prefix (gcloud's, as in launch/tpu_types.py) -> (generation, cores per unit of
# the suffix): v4 and v5p types count TensorCores (2 per chip), v5e and v6e count chips.
_TYPE_PREFIXES = {"v4": ("v4", 2), "v5p": ("v5p", 2), "v5litepod": ("v5e", 1), "v5e": ("v5e", 1), "v6e": ("v6e", 1)}


_TORUS_DIMS = {"v4": 3, "v5p": 3, "v5e": 2, "v6e": 2}


# `device_kind` of a local TPU -> generation (for --target=local).
_DEVICE_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5p": "v5p", "TPU v5": "v5p"}


_DEVICE_KINDS.update({"TPU v6 lite": "v6e", "TPU v6e": "v6e"})


def topology_of_type(name: str, field: str) -> str:
    """`v5p-32` -> `v5p:2x2x4`: the topology name of a Cloud TPU accelerator type."""
    prefix, _, suffix = name.rpartition("-")
    if prefix not in _TYPE_PREFIXES or not suffix.isdigit():
        raise ValueError(
            f"{field}={name!r} is not a known TPU accelerator type; expected <prefix>-<size> with prefix "
            f"one of {sorted(_TYPE_PREFIXES)} (e.g. v5p-32, v5litepod-8, v6e-8, v4-16)"
        )
    generation, cores = _TYPE_PREFIXES[prefix]
    chips, rest = divmod(int(suffix), cores)
    dims = [2, 2, 1] if _TORUS_DIMS[generation] == 3 else [1, 1]
    if rest or chips < math.prod(dims) or chips & (chips - 1):
        smallest = math.prod(dims) * cores
        raise ValueError(
            f"{field}={name!r}: {int(suffix)} is not a slice size of {prefix}; expected a power of two >= {smallest}"
        )
    while math.prod(dims) < chips:  # double the smallest axis (the last of equals): 2x2x1 -> 2x2x2 -> 2x2x4 -> 2x4x4
        axis = max(i for i, d in enumerate(dims) if d == min(dims))
        dims[axis] *= 2
    return f"{generation}:{'x'.join(map(str, dims))}"


def chip_of_topology(topology: str, field: str) -> Chip:
    generation, _, shape = topology.partition(":")
    if generation not in CHIPS or not shape:
        raise ValueError(
            f"{field}={topology!r} is not a TPU topology; expected <generation>:<shape> with generation one "
            f"of {sorted(CHIPS)} (e.g. v5e:2x2, v5p:2x2x4)"
        )
    return CHIPS[generation]


def topology_devices(topology: str, field: str) -> list:
    """The devices of a TPU slice described by `topology`, from libtpu (no TPU needed)."""
    chip_of_topology(topology, field)
    if importlib.util.find_spec("libtpu") is None:
        raise RuntimeError(f"compiling for a TPU topology needs libtpu, which is not installed: {INSTALL}")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another process may hold libtpu
    if "xla_tpu_no_crash_on_oom" not in os.environ.get("LIBTPU_INIT_ARGS", ""):
        # An over-capacity program reports the bytes it asks for instead of failing to compile.
        os.environ["LIBTPU_INIT_ARGS"] = (
            os.environ.get("LIBTPU_INIT_ARGS", "") + " --xla_tpu_no_crash_on_oom=true"
        ).strip()
    from jax.experimental import topologies

    try:
        return list(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)
    except Exception as err:  # libtpu's own message says which part of the name it refused
        raise ValueError(f"{field}={topology!r}: libtpu does not know this topology ({err})") from None


@dataclasses.dataclass(frozen=True)
class RoleTarget:
    """One role to compile: its mesh on its topology's devices."""

    role: str  # "trainer" | "rollout"
    topology: str
    mesh: Mesh
    chip: Chip | None  # None: a local non-TPU device (capacity from the device where it says)
    store_versions_on_device: bool  # the ParamStore's versions live on the trainer's chips (one process)


def _covering_mesh(devices, shape: dict, mesh_field: str, type_field: str, type_name: str) -> Mesh:
    if sharding_lib.mesh_size(shape) != len(devices):
        raise ValueError(
            f"{mesh_field}={shape} spans {sharding_lib.mesh_size(shape)} chips but {type_field}={type_name!r} "
            f"has {len(devices)}; the mesh must cover its slice (e.g. {mesh_field}={{'fsdp': {len(devices)}}})"
        )
    return sharding_lib.make_mesh(devices, shape)


def plan_roles(config: RunConfig, pod, target: str) -> list[RoleTarget]:
    """The roles to compile. `target`: "pod" (the config's `pod` section: `pod` is that ConfigDict),
    "local" (this machine's devices) or a topology name such as "v5e:2x2" (one host's chips); the
    last two split their devices as the embedded run does."""
    trainer_shape, rollout_shape = dict(config.mesh.trainer), dict(config.mesh.rollout)
    if target == "pod":
        if pod is None:
            raise ValueError("the config has no `pod` section; pass --target=local or --target=TOPOLOGY (e.g. v5e:2x4)")
        layout = str(pod.layout)
        trainer_topology = topology_of_type(str(pod.trainer_type), "pod.trainer_type")
        if layout == "single_host":
            return _split_host(config, trainer_topology, topology_devices(trainer_topology, "pod.trainer_type"))
        if layout not in ("slices", "multislice"):
            raise ValueError(f"pod.layout={layout!r}; expected one of ['single_host', 'slices', 'multislice']")
        rollout_field = "pod.rollout_type" if layout == "slices" else "pod.trainer_type"
        rollout_type = str(pod.rollout_type) if layout == "slices" else str(pod.trainer_type)
        rollout_topology = topology_of_type(rollout_type, rollout_field)
        devices = topology_devices(trainer_topology, "pod.trainer_type")
        trainer = _covering_mesh(devices, trainer_shape, "mesh.trainer", "pod.trainer_type", str(pod.trainer_type))
        devices = topology_devices(rollout_topology, rollout_field)
        rollout = _covering_mesh(devices, rollout_shape, "mesh.rollout", rollout_field, rollout_type)
        return [
            RoleTarget("trainer", trainer_topology, trainer, chip_of_topology(trainer_topology, "pod"), False),
            RoleTarget("rollout", rollout_topology, rollout, chip_of_topology(rollout_topology, "pod"), False),
        ]
    if target == "local":
        devices = jax.devices()
        return _split_host(config, f"local:{devices[0].device_kind}x{len(devices)}", devices)
    return _split_host(config, target, topology_devices(target, "--target"))


def _split_host(config: RunConfig, topology: str, devices) -> list[RoleTarget]:
    slices = sharding_lib.split_devices(
        dict(config.mesh.trainer),
        dict(config.mesh.rollout),
        config.rollout.num_slices,
        devices=devices,
        time_shared=config.mesh.time_shared,
    )
    chip = _chip_of_device(devices[0]) if topology.startswith("local:") else chip_of_topology(topology, "--target")
    return [
        RoleTarget("trainer", topology, slices.trainer, chip, True),
        RoleTarget("rollout", topology, slices.rollout[0], chip, True),
    ]


def _chip_of_device(device) -> Chip | None:
    generation = _DEVICE_KINDS.get(device.device_kind)
    return CHIPS[generation] if generation else None
