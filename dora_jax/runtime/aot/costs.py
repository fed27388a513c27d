"""What a compiled program costs: the architecture (`model_config`), the flops and bytes a program must
do (model flops, the matmul flops due, the attention kernel's), XLA's cost analysis, and the estimate
built from them, never below its two floors (`_estimate`)."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dora_jax import models
from dora_jax.runtime import build
from dora_jax.runtime.aot.topology import Chip
from dora_jax.runtime.run_config import RunConfig

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


@dataclasses.dataclass(frozen=True)
class Program:
    name: str
    lower: Callable[[], jax.stages.Lowered]
    trips: int = 1  # scan trips XLA's cost analysis counts once
    model_flops: float | None = None  # per chip, per call
    opaque_flops: float = 0.0  # per chip, per call: inside the splash kernel, which XLA's cost model cannot see
    cost: bool = True  # False: memory only (XLA's cost would count a scanned block once)
    hardware_flops: float | None = None  # per chip, per call: the matmul flops due outside the attention kernel
    weight_bytes: float = 0.0  # per chip, per call (trip): the weights every token multiplies through, read once


def weight_bytes(cfg: models.ModelConfig, dtype, chips: int) -> float:
    """Bytes of the weights one token multiplies through (`matmul_params`) in `dtype`, per chip:
    a forward must read each of them at least once, wherever it is held."""
    return matmul_params(cfg) * jnp.dtype(dtype).itemsize / chips


def rollout_program(name: str, lowered, cfg: models.ModelConfig, chips: int, slots: int) -> Program:
    """A rollout engine program with the model flops and weights its forward cannot avoid: a
    prefill of T positions runs them all through the blocks (causal attention over them) and the
    LM head for its last one at least; a decode step one token per slot through every weight (its
    attention over the cache, which depends on the lengths, left out). Moving a slot's KV rows
    (insert, read_slot) multiplies no weight."""
    head = cfg.hidden_size * cfg.vocab_size
    prefill = re.fullmatch(r"prefill\[T=(\d+)\]", name)
    if prefill:
        T = int(prefill.group(1))
        attention = 2.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * T * T
        flops = 2.0 * (matmul_params(cfg) - head) * T + 2.0 * head + attention
    elif name == "generate" or name.startswith("generate["):
        flops = 2.0 * matmul_params(cfg) * slots
    else:
        return Program(name, lambda: lowered)
    return Program(name, lambda: lowered, model_flops=flops / chips, weight_bytes=weight_bytes(cfg, cfg.dtype, chips))


def scoring_program(name: str, lowered, cfg: models.ModelConfig, chips: int, rows: int, length: int) -> Program:
    """The rollout slice's scoring of finished trajectories (`trainer.behaviour_logps = "rollout"`):
    the trainer's recompute forward over rows x length positions, on the slice's weights in the
    compute dtype."""
    kernel = cfg.attention == "pallas_tpu"
    return Program(
        name,
        lambda: lowered,
        model_flops=train_model_flops(cfg, rows, length) / 3.0 / chips,  # a forward
        opaque_flops=attention_kernel_flops(cfg, rows, length, backward=False) / chips if kernel else 0.0,
        hardware_flops=hardware_flops(cfg, rows, length, backward=False, kernel=kernel) / chips,
        weight_bytes=weight_bytes(cfg, cfg.dtype, chips),
    )


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
    weights = weight_bytes(cfg, cfg.param_dtype, chips)  # the trainer's master weights
    return Program(
        name, lambda: lowered, model_flops=flops / chips, opaque_flops=opaque, hardware_flops=own, weight_bytes=weights
    )


def _cost(compiled) -> tuple[float, float, float]:
    """(flops, bytes accessed, optimal seconds: <= 0 where XLA gives none) as XLA counts them."""
    cost = compiled.cost_analysis()
    cost = (cost[0] if cost else {}) if isinstance(cost, list | tuple) else (cost or {})
    get = lambda key, default=0.0: float(cost.get(key, default))  # noqa: E731
    return get("flops"), get("bytes accessed"), get("optimal_seconds", -1.0)


def _estimate(program: Program, record: dict, chip: Chip | None, cost: tuple, estimate: str) -> dict:
    """A costed program's flops, bytes, estimated time and MFU from XLA's `cost` (flops, bytes,
    seconds: per trip), never below its two floors: model flops at the chip's peak FLOP/s, and its
    compulsory bytes (the weights it multiplies through, read once a trip; the outputs it writes
    that alias no input) at the chip's HBM bandwidth. The estimate says which floor binds."""
    trips = program.trips
    flops, accessed, seconds = (value * trips for value in cost)
    out = {"flops": flops, "bytes_accessed": accessed}
    due = program.hardware_flops * trips if program.hardware_flops else 0.0
    if due:
        # What XLA's own ops must compute: XLA's count falls short of it where the body of a loop
        # is counted once (collective-matmul loops of a program compiled with windowed einsum).
        out["flops_due"] = due
    if program.model_flops is not None:
        out["model_flops"] = program.model_flops
    compulsory = program.weight_bytes * trips + max(0, record["output_bytes"] - record["alias_bytes"])
    out["compulsory_bytes"] = compulsory
    if chip is None:  # a local device of unknown peak: XLA's own seconds, if it gives any
        return out | {"estimated_s": seconds if seconds > 0 else None, "estimate": estimate if seconds > 0 else None}
    if seconds <= 0:
        seconds = max(max(flops, due) / chip.peak_flops, accessed / chip.hbm_bytes_per_s)
        estimate = estimate.replace("xla", "roofline") + (", flops due" if due > flops else "")
    if program.opaque_flops:
        # XLA's cost model sees none of the splash kernel's work: it is added at the chip's peak.
        kernel_s = program.opaque_flops * trips / chip.peak_flops
        out.update(kernel_flops=program.opaque_flops * trips, kernel_s=kernel_s)
        seconds, estimate = seconds + kernel_s, f"{estimate} + kernel at peak"
    floors = {"flops": (program.model_flops or 0.0) / chip.peak_flops, "bytes": compulsory / chip.hbm_bytes_per_s}
    binding = max(floors, key=floors.get)
    out.update(flops_floor_s=floors["flops"], bytes_floor_s=floors["bytes"], floor=binding)
    if seconds < floors[binding]:
        seconds, estimate = floors[binding], f"{binding} floor (the estimate, {estimate}, was below it)"
    out.update(estimated_s=seconds, estimate=estimate)
    if program.model_flops is not None:
        out["mfu"] = mfu_of(program, seconds, chip)
    return out


def mfu_of(program: Program, seconds: float, chip: Chip) -> float:
    """Model flops over `seconds` at the chip's peak; above 100% is an error naming the program (the
    flops floor makes it impossible: an estimate that reads so has left work out)."""
    mfu = program.model_flops / seconds / chip.peak_flops
    if mfu > 1.0 + 1e-9:
        raise AssertionError(f"{program.name}: MFU {mfu:.1%} > 100%: its estimated time is below model flops at peak")
    return mfu


def transient_bytes(record: dict) -> int:
    """Bytes a program needs beyond what is resident: temporaries and outputs aliasing no input."""
    return record["temp_bytes"] + max(0, record["output_bytes"] - record["alias_bytes"])
