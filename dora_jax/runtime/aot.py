"""Ahead-of-time compilation of every program a role runs, for a TPU topology, on a CPU machine.

With `libtpu` installed and `JAX_PLATFORMS=cpu`, `jax.experimental.topologies.get_topology_desc`
hands out the devices of a TPU slice that is not here (`v5p:2x2x4` is a v5p-32), and lowering a
jitted function on `ShapeDtypeStruct`s sharded over a mesh of those devices runs the real TPU
compiler. Its `memory_analysis()` and `cost_analysis()` describe each program on one chip.

`compile_roles(config, pod, target)` builds each role's mesh on its topology (`mesh.trainer` on
the trainer slice, `mesh.rollout` on one rollout slice; a single host splits its chips as the
embedded run does), the params abstractly (`jax.eval_shape` of the model init: no weights in
memory), the Trainer and the RolloutEngine over them (`Trainer.abstract`,
`RolloutEngine.lower_programs`), and compiles: the train step (each bucket length with
`trainer.length_bucket`, else the widest batch), the behaviour recompute, the optimizer update
(inside the whole-batch step, or alone when bucketed); prefill per bucket, generate, insert and
slot export per row bucket (an import is an insert).

Memory per chip: resident = what stays between programs (trainer: params, optimizer state, the
KL reference, the param versions the ParamStore keeps for recompute: K + 1 copies on device in
one process, one at a time read from a tensorstore tier in a multi-slice pod; rollout: params and
the decode state with its KV cache); peak = resident + the largest program's transient bytes
(temporaries plus outputs that alias no input). Time per program: XLA's `optimal_seconds` where
positive, else a roofline max(flops / peak FLOP/s, bytes / HBM bandwidth) marked "roofline".
XLA counts a `lax.scan` body once, so the whole-batch train step is compiled with one micro-batch
per update (M = 1: the same micro-batch program, temporaries and gradient accumulator; inputs M
times smaller) and its flops, bytes and time are XLA's figures times the U x M micro-batch trips
(the optimizer update, U times in truth, is then counted U x M times: small next to a
micro-batch's forward and backward). With `model.scan_layers` the blocks are one scan too: such a
program is compiled whole for its memory, and its cost comes from two probe compiles with the
blocks unrolled (1 and 2 blocks, the vocabulary in one pass, no windowed einsum: nothing XLA
would count once), extrapolated to L blocks; only the widths in `estimate_lengths` get probes.
The splash attention kernel is opaque to XLA's cost model: its flops are added at the chip's peak
(the megablox expert kernels carry cost estimates, which XLA counts). `flops_due` is what the
matmuls must compute, beside XLA's own count.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dora_jax import models
from dora_jax.parallel import sharding as sharding_lib
from dora_jax.rollout.engine import KVPoolTooSmall, RolloutEngine
from dora_jax.runtime import build
from dora_jax.runtime.run_config import RunConfig
from dora_jax.trainer import Trainer
from dora_jax.trainer.bucketed import batch_widths

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

# HF config.json fields of the checkpoints the real configs name (model.hf_path's last part),
# for when the checkpoint is not on this machine.
_QWEN = dict(hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1e6, bos_token_id=151643, use_sliding_window=False)
KNOWN_ARCHITECTURES = {
    "qwen2.5-0.5b-instruct": dict(
        _QWEN,
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        eos_token_id=151645,
    ),
    "qwen2.5-7b": dict(
        _QWEN,
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
        eos_token_id=151643,
    ),
    "qwen3-30b-a3b": dict(
        _QWEN,
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
        eos_token_id=151645,
        attention_bias=False,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
}
KNOWN_ARCHITECTURES["qwen2.5-0.5b"] = KNOWN_ARCHITECTURES["qwen2.5-0.5b-instruct"]
KNOWN_ARCHITECTURES["qwen2.5-7b-instruct"] = KNOWN_ARCHITECTURES["qwen2.5-7b"]


# ---------------------------------------------------------------------------------- topologies
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


# ---------------------------------------------------------------------------------- the model
def model_config(config: RunConfig) -> models.ModelConfig:
    """The architecture: the checkpoint's config.json where it is here, else the known-architecture
    table by the checkpoint's directory name, else a fresh model from the `model` fields."""
    m = config.model
    dtype, param_dtype = models.dtype_from_name(m.dtype), models.dtype_from_name(m.param_dtype)
    path = config.init.checkpoint or m.hf_path
    if not path:
        tokenizer = build.make_tokenizer(config)
        return build.fresh_model_config(config, tokenizer.vocab_size, tokenizer.eos_ids)
    if os.path.exists(os.path.join(path, "config.json")):
        cfg = models.read_config(path, dtype=dtype, param_dtype=param_dtype)
    else:
        name = os.path.basename(os.path.normpath(path)).lower()
        field = "init.checkpoint" if config.init.checkpoint else "model.hf_path"
        if name not in KNOWN_ARCHITECTURES:
            raise ValueError(
                f"{field}={path!r} has no config.json here and {name!r} is not a known architecture "
                f"({', '.join(sorted(KNOWN_ARCHITECTURES))}); point it at a HF checkpoint directory"
            )
        source = f"dora_jax.runtime.aot.KNOWN_ARCHITECTURES[{name!r}]"
        cfg = models.ModelConfig.from_hf(KNOWN_ARCHITECTURES[name], dtype=dtype, param_dtype=param_dtype, source=source)
        for ours, theirs in (("num_layers", "num_layers"), ("hidden_size", "hidden_size"), ("num_heads", "num_heads")):
            if getattr(m, ours) != getattr(cfg, theirs):
                raise ValueError(f"model.{ours}={getattr(m, ours)} but {source} has {getattr(cfg, theirs)}")
    return cfg.replace(moe_dispatch=m.moe_dispatch, attention=m.attention, remat=m.remat, scan_layers=m.scan_layers)


def _abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _in_dtype(tree, dtype):
    """ShapeDtypeStructs with floating leaves in `dtype` (what `models.in_compute_dtype` makes)."""
    cast = lambda x: dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype  # noqa: E731
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, cast(x), sharding=x.sharding), tree)


def bytes_per_chip(tree) -> int:
    """Bytes one device holds of a tree of arrays / ShapeDtypeStructs with NamedShardings."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        total += math.prod(leaf.sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize
    return int(total)


def matmul_params(cfg: models.ModelConfig) -> int:
    """Weights one token multiplies through (the experts it is routed to, the LM head)."""
    attention = cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    dense = 3 * cfg.hidden_size * cfg.intermediate_size
    sparse = 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_experts_per_tok
    sparse += cfg.hidden_size * cfg.num_experts  # the router
    mlp = sum(sparse if cfg.is_moe_layer(i) else dense for i in range(cfg.num_layers))
    return cfg.num_layers * attention + mlp + cfg.hidden_size * cfg.vocab_size


def train_model_flops(cfg: models.ModelConfig, rows: int, length: int) -> float:
    """Model flops of a forward and backward over rows x length tokens (causal attention: half
    of the T x T scores), the usual 6 N D + attention."""
    tokens = rows * length
    attention = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * length * tokens  # 4 L H D T^2 / 2 per row
    return 3.0 * (2 * matmul_params(cfg) * tokens + attention)


# ---------------------------------------------------------------------------------- compiling
@dataclasses.dataclass(frozen=True)
class Program:
    name: str
    lower: Callable[[], jax.stages.Lowered]
    trips: int = 1  # scan trips XLA's cost analysis counts once
    model_flops: float | None = None  # per chip, per call
    opaque_flops: float = 0.0  # per chip, per call: inside the splash kernel, which XLA's cost model cannot see
    cost: bool = True  # False: memory only (XLA's cost would count a scanned block once)
    hardware_flops: float | None = None  # per chip, per call: the matmul flops due outside the attention kernel


def attention_kernel_flops(cfg: models.ModelConfig, rows: int, length: int, *, backward: bool) -> float:
    """Flops of the causal attention kernel over rows x length tokens, all layers: a forward
    pass is 2 matmuls over half the T x T scores (2 L H D T^2 per row); a backward pass 5 (the
    scores again, dP, dS->dQ, dK, dV); rematerialised layers run the forward a second time."""
    forward = 2.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * length * length * rows
    if not backward:
        return forward
    return forward * (2.0 if cfg.remat != "none" else 1.0) + 2.5 * forward


def hardware_flops(cfg: models.ModelConfig, rows: int, length: int, *, backward: bool, kernel: bool) -> float:
    """Flops XLA's own ops must do (outside a Pallas attention kernel when `kernel`): the matmuls
    (and attention where no kernel holds it) forward; with `backward`, twice more for the input
    and weight gradients, plus the forward again where `model.remat` recomputes it ("full": every
    matmul; "dots": attention's batched ones and the experts' projections, which are no
    `dot_general`: ragged dots or Pallas calls). The megablox expert kernels count here: XLA reads
    their cost estimates (2 x rows x in x out a call, over every row handed to the kernel: with
    expert parallelism over P devices, P times the rows of the device's own experts)."""
    tokens = rows * length
    matmul = 2.0 * matmul_params(cfg) * tokens
    attention = 0.0 if kernel else 2.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * length * tokens
    if not backward:
        return matmul + attention
    layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    experts = 2.0 * layers * 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_experts_per_tok * tokens
    again = {"none": 0.0, "dots": attention + experts, "full": matmul + attention}[cfg.remat]
    return 3.0 * (matmul + attention) + again


def _bucketed_program(name: str, lowered, cfg, chips: int, kernel: bool) -> Program:
    """A length-bucketed trainer program with its model flops (grad: forward + backward;
    recompute: forward) and, with the splash kernel, the kernel's flops XLA cannot see."""
    shape = dict(part.split("=") for part in name[name.index("[") + 1 : -1].split(",")) if "[" in name else {}
    if name.startswith("grad["):
        rows, T = int(shape["rows"]), int(shape["T"])
        flops, backward = train_model_flops(cfg, rows, T), True
    elif name.startswith("recompute["):
        rows, T = int(shape["rows"]), int(shape["T"])
        flops, backward = train_model_flops(cfg, rows, T) / 3.0, False
    else:
        return Program(name, lambda: lowered)
    opaque = attention_kernel_flops(cfg, rows, T, backward=backward) / chips if kernel else 0.0
    own = hardware_flops(cfg, rows, T, backward=backward, kernel=kernel) / chips
    return Program(name, lambda: lowered, model_flops=flops / chips, opaque_flops=opaque, hardware_flops=own)


def trainer_programs(config: RunConfig, trainer: Trainer, cfg, chips: int, lengths=()) -> list[Program]:
    t, batch = config.trainer, config.coordinator.train_batch_size
    max_length = config.rollout.cache_length
    kernel = cfg.attention == "pallas_tpu"
    if t.length_bucket:
        widths = batch_widths(max_length, config.pad_to)  # as Trainer.warmup sees them
        return [
            _bucketed_program(name, lowered, cfg, chips, kernel)
            for name, lowered in trainer.lower_bucketed(batch, max_length, widths)
        ]
    lengths = sorted(set(lengths) | {max(batch_widths(max_length, config.pad_to))})  # the widest batch
    U, C = t.num_updates, t.micro_batch_size
    M = batch // (U * C)
    programs = []
    for T in lengths:
        flops = train_model_flops(cfg, batch, T) / chips  # the whole batch: the record is scaled to it
        opaque = attention_kernel_flops(cfg, C, T, backward=True) / chips if kernel else 0.0  # one micro-batch
        programs.append(
            Program(
                f"train_step[B={batch},U={U},M={M},C={C},T={T}]",
                lambda T=T: trainer.lower_train_step(U * C, T),  # one micro-batch per update
                trips=U * M,
                model_flops=flops,
                opaque_flops=opaque,
                hardware_flops=hardware_flops(cfg, C, T, backward=True, kernel=kernel) / chips,
            )
        )
        opaque = attention_kernel_flops(cfg, batch, T, backward=False) / chips if kernel else 0.0
        programs.append(
            Program(
                f"recompute[C={C},T={T}]",
                lambda T=T: trainer.lower_recompute(batch, T),
                opaque_flops=opaque,
                hardware_flops=hardware_flops(cfg, batch, T, backward=False, kernel=kernel) / chips,
            )
        )
    return programs


def _cost(compiled) -> tuple[float, float, float]:
    """(flops, bytes accessed, optimal seconds: <= 0 where XLA gives none) as XLA counts them."""
    cost = compiled.cost_analysis()
    cost = (cost[0] if cost else {}) if isinstance(cost, list | tuple) else (cost or {})
    get = lambda key, default=0.0: float(cost.get(key, default))  # noqa: E731
    return get("flops"), get("bytes accessed"), get("optimal_seconds", -1.0)


# Probe compiles (below) without XLA's windowed einsum: SPMD would otherwise build loops for
# collective matmuls (an FSDP weight gradient: one trip per shard), whose bodies XLA's cost
# analysis counts once. Their time is then XLA's estimate without collective-matmul overlap.
PROBE_OPTIONS = {
    "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False,
    "xla_tpu_enable_windowed_einsum_for_all_gather": False,
}


def compile_program(program: Program, chip: Chip | None, log=print, probes=None) -> dict:
    """One program's record. `probes`: (layers, costs) for a program whose blocks run under
    `lax.scan`, whose body XLA's cost analysis counts once; `costs()` gives XLA's (flops, bytes,
    seconds) of the program compiled with 1 and with 2 blocks unrolled (`_layer_probes`), and its cost is
    extrapolated from those: c1 + (L - 1) (c2 - c1)."""
    start = time.perf_counter()
    record = {"name": program.name}
    try:
        compiled = program.lower().compile()
        flops, accessed, seconds = _cost(compiled)
        estimate = "xla"
        if probes is not None:
            layers, costs = probes
            (f1, b1, s1), (f2, b2, s2) = costs()
            flops, accessed = f1 + (layers - 1) * (f2 - f1), b1 + (layers - 1) * (b2 - b1)
            seconds = s1 + (layers - 1) * (s2 - s1) if min(s1, s2) > 0 else -1.0
            estimate = "xla, layers extrapolated"
    except Exception as err:  # e.g. RESOURCE_EXHAUSTED where libtpu still refuses: report, go on
        record.update(error=f"{type(err).__name__}: {' '.join(str(err).split())[:600]}")
        log(f"  {program.name}: compile failed: {record['error']}")
        return record
    memory = compiled.memory_analysis()
    flops, accessed, seconds = flops * program.trips, accessed * program.trips, seconds * program.trips
    if not program.cost:
        flops, accessed, seconds, estimate = None, None, None, "not estimated (blocks under scan)"
    elif seconds <= 0:
        seconds, estimate = None, None
        if chip is not None:
            seconds = max(flops / chip.peak_flops, accessed / chip.hbm_bytes_per_s)
            estimate = "roofline" + (", layers extrapolated" if probes is not None else "")
    if program.cost and program.hardware_flops:
        # What XLA's own ops must compute: XLA's count falls short of it where the body of a loop
        # is counted once (collective-matmul loops of a program compiled with windowed einsum).
        record["flops_due"] = program.hardware_flops * program.trips
    record.update(
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        flops=flops,
        bytes_accessed=accessed,
        estimated_s=seconds,
        estimate=estimate,
        scan_trips=program.trips,
    )
    if program.opaque_flops and seconds is not None and chip is not None:
        # XLA's cost model sees none of the splash kernel's work: it is added at the chip's peak.
        kernel_s = program.opaque_flops * program.trips / chip.peak_flops
        record.update(kernel_flops=program.opaque_flops * program.trips, kernel_s=kernel_s)
        record["estimated_s"] = seconds = seconds + kernel_s
        record["estimate"] = estimate = f"{estimate} + kernel at peak"
    if program.model_flops is not None:
        record["model_flops"] = program.model_flops
        if seconds and chip is not None:
            record["mfu"] = program.model_flops / seconds / chip.peak_flops
    tflop = "-" if flops is None else f"{flops / 1e12:.3f}"
    log(
        f"  {program.name}: compiled in {time.perf_counter() - start:.1f} s: temp {record['temp_bytes'] / GiB:.2f} "
        f"GiB, {tflop} TFLOP, estimated {seconds} s ({estimate})"
    )
    return record


def transient_bytes(record: dict) -> int:
    """Bytes a program needs beyond what is resident: temporaries and outputs aliasing no input."""
    return record["temp_bytes"] + max(0, record["output_bytes"] - record["alias_bytes"])


def _target_config(cfg, target: RoleTarget):
    if cfg.attention == "auto" and target.mesh.devices.flat[0].platform == "tpu":
        # "auto" reads the default backend, which is this host's CPU while compiling for TPU chips.
        cfg = cfg.replace(attention="pallas_tpu")
    return cfg


def probe_costs(
    config: RunConfig, target: RoleTarget, cfg, *, train_lengths=(), estimate_lengths=None, log=print
) -> dict:
    """XLA's [flops, bytes, seconds] of the trainer's cost probes, {program name: [1 block, 2
    blocks]}: the part of the trainer role that `compile_role(probes_from=...)` takes from another
    process (tpu_compile --jobs=2 has the rollout role's process compile them after its own)."""
    cfg = _target_config(cfg, target)
    trainer = _abstract_trainer(cfg, target.mesh, config.trainer)
    programs = trainer_programs(config, trainer, cfg, int(target.mesh.devices.size), train_lengths)
    costs = {}
    for name, (_, pair) in _layer_probes(config, target, cfg, programs, train_lengths, estimate_lengths).items():
        start = time.perf_counter()
        costs[name] = [list(probe()) for probe in pair]
        log(f"  {name}: cost probes (1 and 2 blocks) compiled in {time.perf_counter() - start:.1f} s")
    return costs


def compile_role(
    config: RunConfig,
    target: RoleTarget,
    cfg,
    *,
    train_lengths=(),
    estimate_lengths=None,
    log=print,
    probes_from: Callable[[str], list] | None = None,
) -> dict:
    """One role's record. With `model.scan_layers`, the trainer programs at `estimate_lengths`
    (default: the one width nearest 4096) get cost estimates from unrolled 1- and 2-block probe
    compiles; the other scanned programs are compiled for their memory only (estimate None).
    `probes_from(name)`: those probes' costs from elsewhere (`probe_costs`, in another process;
    may wait for them), asked for after every other program has compiled."""
    log(f"{target.role} on {target.topology} ({target.mesh.devices.size} chips, mesh {dict(target.mesh.shape)}):")
    cfg = _target_config(cfg, target)
    chips = int(target.mesh.devices.size)
    probes = {}
    kv = {}
    if target.role == "trainer":
        trainer = _abstract_trainer(cfg, target.mesh, config.trainer)
        params = bytes_per_chip(trainer.state.params)
        versions = config.coordinator.k_max + 1 if target.store_versions_on_device else 1
        resident = {
            "params": params,
            "optimizer_state": bytes_per_chip(trainer.state) - params,
            "kl_reference": params if config.trainer.kl_coef > 0 else 0,
            # versions are published in the compute dtype (Trainer.serve_dtype)
            f"param_versions_x{versions}": bytes_per_chip(_in_dtype(trainer.state.params, cfg.dtype)) * versions,
        }
        programs = trainer_programs(config, trainer, cfg, chips, train_lengths)
        probes = {
            name: (
                layers,
                (lambda pair=pair: [probe() for probe in pair])
                if probes_from is None
                else (lambda name=name: probes_from(name)),
            )
            for name, (layers, pair) in _layer_probes(
                config, target, cfg, programs, train_lengths, estimate_lengths
            ).items()
        }
    else:
        engine_config = config.rollout.engine_config()
        hbm = target.chip.hbm_bytes if target.chip else None  # sizes a paged pool of rollout.kv_pages 0
        try:
            engine = RolloutEngine(cfg, engine_config, target.mesh, hbm_bytes=hbm)
        except KVPoolTooSmall as err:  # compile with the smallest pool: the record says it does not fit
            log(f"  {err}; compiling with a pool of one request")
            smallest = dataclasses.replace(engine_config, num_pages=engine_config.pages_per_slot + 1)
            engine = RolloutEngine(cfg, smallest, target.mesh)
        served = models.split(models.abstract_model(engine.model_config))[1]  # in the compute dtype
        resident = {
            "params": bytes_per_chip(_abstract(served, engine.param_shardings)),
            "decode_state": bytes_per_chip(engine.abstract_decode_state()),
        }
        kv = kv_capacity(config, engine)
        programs = [Program(name, lambda lowered=lowered: lowered) for name, lowered in engine.lower_programs()]
    records = {}
    # Probes from another process are waited for last: everything else compiles meanwhile.
    order = sorted(range(len(programs)), key=lambda i: probes_from is not None and programs[i].name in probes)
    for i in order:
        program = programs[i]
        scanned_only = cfg.scan_layers and target.role == "trainer" and program.name not in probes
        if scanned_only and _width(program.name) is not None:
            program = dataclasses.replace(program, cost=False)  # XLA would count one block only
        records[i] = compile_program(program, target.chip, log, probes.get(program.name))
    records = [records[i] for i in range(len(programs))]
    if kv and target.role == "rollout":
        kv |= _kernel_reads(engine, kv, records, target.chip)
        kv["migration_rule"] = migration_rule(config, engine, records)
    return _role_record(target, resident, records) | kv


def migration_rule(config: RunConfig, engine: RolloutEngine, records: list[dict]) -> list[dict]:
    """The migration rule (dora_jax.rollout.migration) on compiled costs: per prefix length (a
    quarter of a prefill chunk, one chunk, the longest a re-prefill takes), moving the slot's KV
    rows at `rollout.kv_link_bytes_per_s` against re-prefilling with the prefill programs'
    estimated times; what the rule picks. A slice measures both at run time and decides on those."""
    from dora_jax.rollout.migration import MigrationCosts

    ec, cfg = engine.config, engine.model_config
    estimates = {}
    for record in records:
        found = re.fullmatch(r"prefill\[T=(\d+)\]", record["name"])
        if found and record.get("estimated_s") is not None:
            estimates[int(found.group(1))] = record["estimated_s"]
    costs = MigrationCosts(link_bytes_per_s=config.rollout.kv_link_bytes_per_s, prefill_seconds=estimates)
    row_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
    rows = []
    longest = min(2 * ec.max_prefill_length, ec.cache_length - 1) - 1
    for tokens in sorted({ec.max_prefill_length // 4, ec.max_prefill_length, longest}):
        try:
            chunks = ec.prefill_chunks(tokens + 1)
        except ValueError:  # a re-prefill this long would overflow the cache: no choice to make
            continue
        buckets = [next(b for b in ec.prefill_buckets if b >= n) for n in chunks]
        moved = ec.rows_bucket(tokens) * row_bytes
        rows.append(
            {
                "prefix_tokens": tokens,
                "kv_bytes_moved": moved,
                "kv_s_at_link": costs.kv_s(moved),
                "reprefill_s_estimate": costs.reprefill_s(buckets),
                "rule": costs.choose(moved, buckets),
            }
        )
    return rows


def _kernel_reads(engine: RolloutEngine, kv: dict, records: list[dict], chip: Chip | None) -> dict:
    """What XLA cannot see in the paged decode step: the ragged paged attention kernel's KV reads
    per chip with every slot at the workload's mean length, and the step's estimate with them."""
    if not engine.paged_kernel:
        return {}
    per_token = engine.kv_bytes_per_page() / engine.config.page_size
    reads = per_token * kv["mean_sequence_length"] * kv["max_concurrent_sequences"]
    out = {"kernel_kv_bytes_per_step": int(reads)}
    step = next((r for r in records if r["name"] == "generate" and "error" not in r), None)
    if step is not None and step["estimated_s"] is not None and chip is not None:
        out["decode_step_estimate_s"] = step["estimated_s"] + reads / chip.hbm_bytes_per_s
        out["decode_tokens_per_s_estimate"] = kv["max_concurrent_sequences"] / out["decode_step_estimate_s"]
    return out


def kv_capacity(config: RunConfig, engine: RolloutEngine) -> dict:
    """The rollout slice's KV capacity: page size, pool tokens, cache length, and how many sequences
    of the workload's mean prompt + response length it holds at once (the paper's response-length
    shape scaled to `rollout.max_new_tokens`, prompts at `task.source.max_prompt_tokens`: the
    config has no length distribution of its own), against a dense cache of the same bytes."""
    from dora_jax.sim.projection import project_workload
    from dora_jax.sim.workload import WorkloadSpec, mean_response

    ec = engine.config
    fields = {
        "rollout": {"max_new_tokens": config.rollout.max_new_tokens, "cache_length": ec.cache_length},
        "coordinator": {
            "group_size": config.coordinator.group_size,
            "train_batch_size": config.coordinator.train_batch_size,
        },
        "task": {"source": {"max_prompt_tokens": _max_prompt_tokens(config)}},
    }
    workload = project_workload(fields, WorkloadSpec(), 0, "the config")
    mean_length = workload.prompt_tokens + mean_response(workload)
    pool_tokens = (ec.pool_pages - 1) * ec.page_size if ec.paged else ec.num_slots * ec.cache_length
    at_mean = int(pool_tokens // mean_length)
    return {
        "kv_page_size": ec.page_size,
        "kv_pool_tokens": int(pool_tokens),
        "cache_length": ec.cache_length,
        "mean_sequence_length": round(float(mean_length), 1),
        "pool_sequences_at_mean_length": at_mean,  # what the pool holds; slots (rollout.slots) may bind first
        "max_concurrent_sequences": min(ec.num_slots, at_mean),
        "dense_concurrent_sequences_same_bytes": int(min(ec.num_slots, pool_tokens // ec.cache_length)),
    }


def _max_prompt_tokens(config: RunConfig) -> int:
    source = getattr(config.task, "source", None)
    value = getattr(source, "max_prompt_tokens", 0) if source is not None else 0
    return int(value or 0) or config.rollout.cache_length - config.rollout.max_new_tokens


def _width(name: str) -> int | None:
    """The T of a program named like `grad[rows=16,T=4096]`; None for one without rows."""
    found = re.search(r"\bT=(\d+)", name)
    return int(found.group(1)) if found else None


def _abstract_trainer(cfg: models.ModelConfig, mesh: Mesh, trainer_config) -> Trainer:
    graphdef, abstract_params = models.split(models.abstract_model(cfg))
    axes = models.logical_axes(models.abstract_model(cfg))
    return Trainer.abstract(graphdef, abstract_params, axes, mesh, trainer_config)


def _layer_probes(config: RunConfig, target: RoleTarget, cfg, programs, train_lengths, estimate_lengths) -> dict:
    """{program name: (layers, [probe with 1 block, with 2 blocks])} for the trainer's programs that
    run the blocks under `lax.scan` (model.scan_layers), at `estimate_lengths` (default: the one
    width nearest 4096); {} without scanned blocks. A probe compiles the program with its blocks
    unrolled and the vocabulary in one pass (no scan XLA would count once either) and returns XLA's
    whole (flops, bytes, seconds), and two of them give the cost of one more block."""
    if not cfg.scan_layers:
        return {}
    widths = sorted({_width(p.name) for p in programs} - {None})
    if estimate_lengths is None:  # the width nearest 4K tokens
        estimate_lengths = [min(widths, key=lambda T: abs(math.log2(T / 4096)))] if widths else []
    unknown = sorted(set(estimate_lengths) - set(widths))
    if unknown:
        raise ValueError(f"--estimate_lengths={unknown} are not widths the trainer compiles; expected some of {widths}")
    options = PROBE_OPTIONS if target.mesh.devices.flat[0].platform == "tpu" else None
    trainer_config = dataclasses.replace(config.trainer, vocab_chunk=0)
    probe_config = dataclasses.replace(config, trainer=trainer_config)
    probes: dict[str, list] = {}
    for layers in (1, 2):
        small = cfg.replace(num_layers=layers, scan_layers=False)
        trainer = _abstract_trainer(small, target.mesh, trainer_config)
        for program in trainer_programs(probe_config, trainer, small, int(target.mesh.devices.size), train_lengths):
            if _width(program.name) in estimate_lengths:
                probe = lambda lower=program.lower: _cost(lower().compile(compiler_options=options))  # noqa: E731
                probes.setdefault(program.name, []).append(probe)
    return {name: (cfg.num_layers, pair) for name, pair in probes.items()}


def _role_record(target: RoleTarget, resident: dict, records: list[dict]) -> dict:
    capacity = target.chip.hbm_bytes if target.chip else _device_limit(target.mesh)
    compiled = [r for r in records if "error" not in r]
    largest = max(compiled, key=transient_bytes, default=None)
    resident_total = sum(resident.values())
    peak = resident_total + (transient_bytes(largest) if largest else 0)
    fits = None if capacity is None else bool(peak <= capacity and len(compiled) == len(records))
    return {
        "role": target.role,
        "topology": target.topology,
        "chips": int(target.mesh.devices.size),
        "mesh": {k: int(v) for k, v in target.mesh.shape.items()},
        "hbm_capacity_bytes_per_chip": capacity,
        "resident_bytes_per_chip": resident_total,
        "resident_breakdown": resident,
        "peak_bytes_per_chip": peak,
        "largest_program": largest["name"] if largest else None,
        "fits": fits,
        "programs": records,
    }


def _device_limit(mesh: Mesh) -> int | None:
    stats = mesh.devices.flat[0].memory_stats() or {}
    return stats.get("bytes_limit")


def compile_roles(
    config: RunConfig,
    pod,
    target: str,
    *,
    train_lengths=(),
    estimate_lengths=None,
    roles=("trainer", "rollout"),
    log=None,
    on_role=None,
    probes_in: str | None = None,
    probes_out: str | None = None,
):
    """compile.json's content (without "config") for `config` on `target` (see `plan_roles`).
    `on_role(partial_result)` is called after each role (big models compile for many minutes).
    Two processes can share the trainer's work: the one given `probes_out` compiles the trainer's
    cost probes after its own roles and writes their costs there (`write_probe_costs`); the one
    given `probes_in` takes them from there, waiting for the file once everything else has compiled."""
    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    cfg = model_config(config)
    plans = plan_roles(config, pod, target)
    cache = jax.config.jax_enable_compilation_cache
    # A TPU executable compiled for a topology cannot be read back without a TPU client: no cache.
    jax.config.update("jax_enable_compilation_cache", target == "local" and cache)
    records = []
    costs_in = None if probes_in is None else read_probe_costs(probes_in)
    try:
        for plan in [p for p in plans if p.role in roles]:
            records.append(
                compile_role(
                    config,
                    plan,
                    cfg,
                    train_lengths=train_lengths,
                    estimate_lengths=estimate_lengths,
                    log=log,
                    probes_from=costs_in,
                )
            )
            if on_role is not None:
                on_role(result_of(records))
        if probes_out is not None:
            (trainer,) = [p for p in plans if p.role == "trainer"]
            costs = probe_costs(
                config, trainer, cfg, train_lengths=train_lengths, estimate_lengths=estimate_lengths, log=log
            )
            write_probe_costs(probes_out, costs=costs)
    except BaseException as err:
        if probes_out is not None and not os.path.exists(probes_out):
            write_probe_costs(probes_out, error=f"{type(err).__name__}: {err}")
        raise
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)
    return result_of(records)


def write_probe_costs(path: str, *, costs: dict | None = None, error: str | None = None) -> None:
    """The trainer's cost probes, {"costs": {program: [[flops, bytes, s] x 2]}} or {"error": why},
    written whole (a reader never sees half a file)."""
    with open(path + ".tmp", "w") as f:
        json.dump({"costs": costs} if error is None else {"error": error}, f)
    os.replace(path + ".tmp", path)


def read_probe_costs(path: str, poll_s: float = 1.0) -> Callable[[str], list]:
    """`costs(program name)` from the file `write_probe_costs` writes, waiting for it to appear;
    RuntimeError naming the file when the other process failed or did not probe that program."""
    costs: dict = {}

    def get(name: str) -> list:
        if not costs:
            while not os.path.exists(path):
                time.sleep(poll_s)
            with open(path) as f:
                data = json.load(f)
            if "error" in data:
                raise RuntimeError(f"the trainer's cost probes failed in the other process ({path}): {data['error']}")
            costs.update(data["costs"])
        if name not in costs:
            raise RuntimeError(f"{path} holds no cost probes for {name}; it has {sorted(costs)}")
        return costs[name]

    return get


def result_of(records: list[dict]) -> dict:
    """compile.json's content (without "config") for these role records."""
    return {"roles": records, "fits": all(r["fits"] is not False for r in records)}


def does_not_fit(result: dict) -> list[str]:
    """One line per role that does not fit: the program, its bytes and the capacity."""
    lines = []
    for role in result["roles"]:
        if role["fits"] is not False:
            continue
        failed = [p["name"] for p in role["programs"] if "error" in p]
        if failed:
            lines.append(f"{role['role']} on {role['topology']}: {', '.join(failed)} did not compile")
        largest = next((p for p in role["programs"] if p["name"] == role["largest_program"]), None)
        if role["peak_bytes_per_chip"] > role["hbm_capacity_bytes_per_chip"] and largest is not None:
            gib = lambda n: f"{n / GiB:.2f} GiB"  # noqa: E731
            lines.append(
                f"{role['role']} on {role['topology']} does not fit: {largest['name']} needs "
                f"{gib(transient_bytes(largest))} per chip on top of {gib(role['resident_bytes_per_chip'])} "
                f"resident = {gib(role['peak_bytes_per_chip'])} > {gib(role['hbm_capacity_bytes_per_chip'])} HBM; "
                + _what_would_fit(role, largest)
            )
    return lines


def _what_would_fit(role: dict, largest: dict) -> str:
    """Which config fields to change, and by about how much, for `role` to fit its HBM."""
    capacity, resident = role["hbm_capacity_bytes_per_chip"], role["resident_bytes_per_chip"]
    mesh_field = f"mesh.{role['role']}"
    more_chips = f"more chips (pod.{role['role']}_type, {mesh_field})"
    if resident >= capacity:
        return f"the resident state alone is {resident / GiB:.2f} GiB: {more_chips}"
    room = capacity - resident
    if role["role"] == "rollout":
        kv = role["resident_breakdown"].get("decode_state", 0)
        fixed = resident - kv + transient_bytes(largest)
        if kv and fixed < capacity:
            share = (capacity - fixed) / kv
            return (
                f"the KV cache (rollout.slots x rollout.cache_length) takes {kv / GiB:.2f} GiB: about "
                f"{share:.2f}x of it would fit, or {more_chips}"
            )
        return f"{more_chips}, or a smaller rollout.max_prefill_length"
    share = room / transient_bytes(largest)
    return (
        f"its temporaries scale with the micro-batch (trainer.micro_batch_tokens, trainer.micro_batch_size): "
        f"about {share:.2f}x of it would fit, or {more_chips}, or model.remat='full'"
    )


def table(result: dict) -> str:
    """The roles and their programs as text."""
    gib = lambda n: "-" if n is None else f"{n / GiB:.2f}"  # noqa: E731
    lines = [f"{'role':8} {'topology':12} {'chips':>5} {'resident GiB':>12} {'peak GiB':>9} {'HBM GiB':>8}  fits"]
    for r in result["roles"]:
        lines.append(
            f"{r['role']:8} {r['topology']:12} {r['chips']:>5} {gib(r['resident_bytes_per_chip']):>12} "
            f"{gib(r['peak_bytes_per_chip']):>9} {gib(r['hbm_capacity_bytes_per_chip']):>8}  {r['fits']}"
        )
    lines.append("")
    lines.append(f"{'program':52} {'temp GiB':>9} {'args GiB':>9} {'TFLOP':>9} {'est ms':>9}  estimate")
    for r in result["roles"]:
        for p in r["programs"]:
            if "error" in p:
                lines.append(f"{r['role'] + ' ' + p['name']:52} {p['error']}")
                continue
            ms = "-" if p["estimated_s"] is None else f"{p['estimated_s'] * 1e3:.2f}"
            name = f"{r['role']} {p['name']}"
            tflop = "-" if p["flops"] is None else f"{p['flops'] / 1e12:.3f}"
            lines.append(
                f"{name:52} {gib(p['temp_bytes']):>9} {gib(p['argument_bytes']):>9} {tflop:>9} "
                f"{ms:>9}  {p['estimate']}" + (f" (MFU {p['mfu']:.1%})" if "mfu" in p else "")
            )
    return "\n".join(lines)
