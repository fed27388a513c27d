"""Device slices, meshes and the logical-axis rule tables.

The local devices are split into one trainer slice and R rollout slices, each a `Mesh` over the
axes `data`, `fsdp`, `tensor`, `expert`. Model code only names dimensions (`embed`, `heads`, ...);
a rule table maps those names to mesh axes, and `tree_shardings` turns a params tree plus its
logical axes into `NamedSharding`s for one mesh. Moving params from the trainer's layout to a
rollout slice's is `reshard(params, tree_shardings(axes, params, rollout_mesh, ROLLOUT_RULES))`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax.core import spmd
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# A rule maps one logical name to a mesh axis, a tuple of mesh axes, or None (replicated).
Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

# Trainer: FSDP over `embed`, tensor parallel over heads/mlp/vocab, experts over `expert`, batch
# over data x fsdp x expert (the expert-parallel devices hold different rows: attention and the
# dense layers are not computed again on each of them; the MoE layers all-gather their tokens).
TRAINER_RULES: Rules = (
    ("batch", ("data", "fsdp", "expert")),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("expert", "expert"),
    ("head_dim", None),
    ("norm", None),
    ("layers", None),
    ("length", None),
)

# Rollout: tensor parallel only (weights whole along embed), decode slots over `data`.
ROLLOUT_RULES: Rules = (
    ("batch", "data"),
    ("embed", None),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("expert", "expert"),
    ("head_dim", None),
    ("norm", None),
    ("layers", None),
    ("length", None),
)


@dataclasses.dataclass(frozen=True)
class Slices:
    """The meshes carved out of the local devices."""

    trainer: Mesh
    rollout: tuple[Mesh, ...]
    time_shared: bool = False


def mesh_size(shape: Mapping[str, int]) -> int:
    return math.prod(shape.values())


def make_mesh(devices: Sequence[jax.Device], shape: Mapping[str, int]) -> Mesh:
    """A mesh over `devices` with every axis of MESH_AXES (missing axes have size 1)."""
    unknown = set(shape) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"mesh shape has unknown axes {sorted(unknown)}; expected a subset of {MESH_AXES}")
    dims = tuple(int(shape.get(axis, 1)) for axis in MESH_AXES)
    if math.prod(dims) != len(devices):
        raise ValueError(f"mesh shape {dict(shape)} needs {math.prod(dims)} devices but got {len(devices)}")
    return Mesh(np.asarray(devices, dtype=object).reshape(dims), MESH_AXES)


def split_devices(
    trainer_shape: Mapping[str, int],
    rollout_shape: Mapping[str, int],
    num_rollout_slices: int,
    *,
    devices: Sequence[jax.Device] | None = None,
    time_shared: bool = False,
) -> Slices:
    """Carves the trainer slice then `num_rollout_slices` rollout slices out of `devices`.

    Disjoint by default. With `time_shared=True` (one Colab GPU, a single TPU core) slices that do
    not fit are laid over the same devices again, round-robin; without it that is an error.
    """
    devices = list(jax.devices() if devices is None else devices)
    if num_rollout_slices < 1:
        raise ValueError(f"rollout.num_slices={num_rollout_slices}; expected >= 1")
    n_train, n_roll = mesh_size(trainer_shape), mesh_size(rollout_shape)
    needed = n_train + num_rollout_slices * n_roll
    if needed > len(devices) and not time_shared:
        raise ValueError(
            f"device split asks for {needed} devices (trainer {dict(trainer_shape)} = {n_train}, "
            f"{num_rollout_slices} rollout slices x {dict(rollout_shape)} = {n_roll} each) but only "
            f"{len(devices)} exist; shrink the meshes or set mesh.time_shared=True"
        )
    if max(n_train, n_roll) > len(devices):
        raise ValueError(f"one slice needs {max(n_train, n_roll)} devices but only {len(devices)} exist")

    cursor = 0

    def take(count: int) -> list[jax.Device]:
        nonlocal cursor
        if cursor + count > len(devices):
            cursor = 0
        chosen = devices[cursor : cursor + count]
        cursor += count
        return chosen

    trainer = make_mesh(take(n_train), trainer_shape)
    rollout = tuple(make_mesh(take(n_roll), rollout_shape) for _ in range(num_rollout_slices))
    return Slices(trainer=trainer, rollout=rollout, time_shared=needed > len(devices))


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: Rules) -> PartitionSpec:
    """The PartitionSpec for one array with logical axis `names` on `mesh`.

    A dimension stays replicated when its rule maps to None, to mesh axes of size 1, to a mesh
    axis already used by an earlier dimension, or when its size is not divisible by the mesh axes'
    product (tiny models on big meshes): placement never fails for shape reasons. Of a rule's
    several mesh axes, the longest leading run whose product divides the size is used (8 rows on
    data 1 x fsdp 4 x expert 4: over fsdp).
    """
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for name, dim in zip(names, shape, strict=True):
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise ValueError(f"logical axis {name!r} has no rule; rules cover {sorted(table)}")
        target = table[name]
        axes = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
        axes = tuple(a for a in axes if mesh.shape.get(a, 1) > 1 and a not in used)
        while axes and dim % math.prod(mesh.shape[a] for a in axes):
            axes = axes[:-1]
        if not axes:
            spec.append(None)
            continue
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Lays out an activation by its logical axis `names`, through the mesh (`jax.set_mesh`) and the
    rule table (`nnx.logical_axis_rules`) the caller traces under (`activation_layout`: the trainer's
    programs and the rollout engine's); without both, `x` as it is. A dimension whose rule's mesh
    axis an earlier one took stays whole: with batch over (data, fsdp), `embed` (fsdp for params) is
    not split again."""
    mesh, rules = jax.sharding.get_abstract_mesh(), spmd.get_logical_axis_rules()
    if mesh.empty or not rules:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, x.shape, mesh, rules))


@contextlib.contextmanager
def activation_layout(mesh: Mesh, rules: Rules):
    """Inside a traced function: the mesh and rule table by which `constrain` lays activations
    out and the Pallas kernels (attention, paged attention, megablox) are mapped over devices."""
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), spmd.logical_axis_rules(rules):
        yield


def logical_sharding(names, shape, mesh: Mesh, rules: Rules) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(names, shape, mesh, rules))


def tree_shardings(axes_tree, values_tree, mesh: Mesh, rules: Rules):
    """NamedShardings for every leaf of `values_tree` (arrays or ShapeDtypeStructs).

    `axes_tree` has the same structure with a PartitionSpec of logical names per leaf (as
    `dora_jax.models.logical_axes` returns).
    """
    return jax.tree.map(
        lambda names, value: logical_sharding(tuple(names), value.shape, mesh, rules),
        axes_tree,
        values_tree,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def reshard(tree, shardings):
    """Moves a pytree of arrays to new shardings (another mesh or another layout): one call."""
    return jax.device_put(tree, shardings)
