"""The projection: a real config's pod and costs for the simulator, from `tpu_compile`'s estimates.

    python -m dora_jax.sim --config=configs/sim_paper.py \
        --compile=/tmp/7b_trainer/compile.json --compile=/tmp/7b_rollout/compile.json --out=/tmp/proj

`python -m dora_jax.tpu_compile --config=CONFIG --roles=trainer|rollout --out=DIR` writes
DIR/compile.json: the run config, and per role the chips, the resident bytes per chip and, per
compiled program, XLA's estimated seconds on one chip (`estimated_s`: the compiler's
`optimal_seconds`, or a roofline where it gives none; for the trainer's scanned blocks, two probe
compiles with 1 and 2 unrolled blocks extrapolated to L, only at the widths in
`--estimate_lengths`, by default the one nearest 4096: the others are null). Every number here
is such an estimate, not a measurement. The mapping (one pod of the config: the trainer slice
and `rollout.num_slices` rollout slices, all split, as `pod.layout` deploys them):
- decode: t(a) = t0 + t1 a with t0 = `generate` (one step over every one of `rollout.slots`
  slots) and t1 = 0: the step is one fixed shape over a dense KV cache of `cache_length` tokens a
  slot, so an idle slot costs what a busy one does. That is today's engine, not a fit.
- prefill: seconds per token of the largest `prefill[T=..]` bucket (a full chunk: longer contexts
  prefill in such chunks; short prompts pay a latency floor this leaves out).
- train: per micro-batch width T, (grad + grad_sum) / (rows x T) + recompute / (its rows x T)
  slice-seconds per padded position. Widths XLA did not estimate are scaled from the estimated
  ones at the same seconds per model flop (constant MFU). The trainer pads each micro-batch to
  `length_bucket x 2^k` (capped at cache_length), so the cost per trained token averages bucket(l)
  x cost(bucket(l)) over the workload's sample lengths l = prompt + response, divided by their
  mean. Recompute is charged on every row (what an asynchronous step pays); sync's first update
  reuses its own forward's log-probs, so sync's train time is overstated by recompute / U (the
  notes give the seconds). Under trainer.behaviour_logps = "sampler" nothing is recomputed (no
  recompute program is compiled) and none is charged. Fixed per step: num_updates x `optimizer_update`.
- weight load: the rollout slice's params (bytes per chip x chips) over `weight_load_bytes_per_s`;
  KV migration: `decode_state` bytes / (slots x cache_length) per token over
  `migrate_bytes_per_s`. Both bandwidths are assumed constants of the sim config (`projection`).
- workload: TBS / G prompts of G samples (`coordinator.train_batch_size` counts samples), RBS,
  K and the rebalance period from the config; prompts of `task.source.max_prompt_tokens` (the
  budget, as the paper scenario uses its 2K budget) unless `projection.prompt_tokens` says
  otherwise; response lengths of the sim config's shape (median / max and the batch's expected
  max / median kept) with max = `rollout.max_new_tokens`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dora_jax.core.modes import Mode
from dora_jax.sim.cluster import DecodeModel, Placement
from dora_jax.sim.scenario import CostModel, Placements, Scenario, from_config
from dora_jax.sim.workload import WorkloadSpec, draw_lengths, mean_response

LABEL = (
    "PROJECTION from XLA's estimates (tpu_compile's estimated_s for the config's compiled programs), not a measurement"
)
_TRAIN_PROGRAM = re.compile(r"^(grad|recompute)\[rows=(\d+),T=(\d+)\]$")
_PREFILL_PROGRAM = re.compile(r"^prefill\[T=(\d+)\]$")
_LENGTH_DRAWS = 200_000  # sample lengths drawn to average the trainer's padding over
# For results.json: where each cost comes from (the module docstring has the reasons).
MAPPING = dict(
    decode="t0 = generate's estimated_s (one step over every slot), t1 = 0: fixed shape, dense KV cache",
    prefill="estimated_s / T of the largest prefill[T] bucket",
    train="per width T: (grad + grad_sum) / (rows x T) + recompute / (rows x T) slice-seconds per padded "
    "position (unestimated widths at the estimated ones' seconds per model flop), averaged over the "
    "workload's samples padded to their length bucket, x trainer chips; + num_updates x optimizer_update "
    "per step",
    weight_load="rollout params bytes per chip x chips / projection.weight_load_bytes_per_s (assumed)",
    kv_migration="decode_state bytes per chip x chips / (slots x cache_length) per token, over "
    "projection.migrate_bytes_per_s (assumed)",
    workload="TBS / G prompts x G, prompt = task.source.max_prompt_tokens (or projection.prompt_tokens), "
    "responses: the sim config's log-normal shape scaled to rollout.max_new_tokens",
)


@dataclasses.dataclass(frozen=True)
class TrainWidth:
    """The trainer at one micro-batch width T, in trainer-slice seconds per call."""

    width: int
    grad_rows: int
    grad_s: float
    recompute_rows: int
    recompute_s: float
    estimated: bool  # False: scaled from the estimated widths at their seconds per model flop

    def s_per_position(self, grad_sum_s: float) -> float:
        """Slice-seconds per padded position: gradient, its accumulation and the recompute."""
        grad = (self.grad_s + grad_sum_s) / (self.grad_rows * self.width)
        return grad + self.recompute_s / (self.recompute_rows * self.width)


@dataclasses.dataclass(frozen=True)
class Estimates:
    """What a config's compile.json files say, in the units the cost model takes (XLA's figures)."""

    sources: tuple[str, ...]
    name: str  # pod.name
    trainer_type: str
    rollout_type: str
    trainer_chips: int
    rollout_chips: int  # per rollout slice
    rollout_slices: int
    slots: int  # per rollout slice
    cache_length: int
    decode_step_s: float  # `generate`: one decode step over every slot
    prefill_width: int
    prefill_s: float
    train_widths: tuple[TrainWidth, ...]
    grad_sum_s: float
    optimizer_update_s: float
    num_updates: int
    length_bucket: int
    rollout_param_bytes: int  # per chip
    decode_state_bytes: int  # per chip

    @property
    def total_chips(self) -> int:
        return self.trainer_chips + self.rollout_slices * self.rollout_chips

    @property
    def weight_bytes(self) -> int:
        """A rollout slice's copy of the params (tensor-parallel shards; replicated ones counted per chip)."""
        return self.rollout_param_bytes * self.rollout_chips

    @property
    def kv_bytes_per_token(self) -> float:
        return self.decode_state_bytes * self.rollout_chips / (self.slots * self.cache_length)

    def width(self, T: int) -> TrainWidth:
        for w in self.train_widths:
            if w.width == T:
                return w
        raise ValueError(
            f"{self.sources}: no grad/recompute program of width T={T} (have {[w.width for w in self.train_widths]})"
        )


@dataclasses.dataclass(frozen=True)
class TrainCost:
    """The trainer slice's seconds per real (prompt + response) token of a workload."""

    s_per_token: float  # everything: gradient, accumulation, recompute, padding
    recompute_s_per_token: float  # of which the behaviour recompute
    padding_factor: float  # padded positions / real tokens
    s_per_position: float  # s_per_token / padding_factor


@dataclasses.dataclass(frozen=True)
class Projection:
    """A real config projected onto the simulator: the estimates, the derived costs, the scenario."""

    estimates: Estimates
    train: TrainCost  # over the workload's sample lengths
    weight_load_bytes_per_s: float
    migrate_bytes_per_s: float
    scenario: Scenario

    def as_dict(self) -> dict:
        """The `projection` block of results.json: where every cost came from."""
        e, costs, w = self.estimates, self.scenario.costs, self.scenario.workload
        widths = {
            str(t.width): dict(
                grad_rows=t.grad_rows,
                grad_s=t.grad_s,
                recompute_rows=t.recompute_rows,
                recompute_s=t.recompute_s,
                estimated=t.estimated,
                s_per_position=t.s_per_position(e.grad_sum_s),
            )
            for t in e.train_widths
        }
        return dict(
            label=LABEL,
            sources=list(e.sources),
            pod=dict(
                name=e.name,
                trainer=f"{e.trainer_type} ({e.trainer_chips} chips)",
                rollout=f"{e.rollout_slices} x {e.rollout_type} ({e.rollout_chips} chips each)",
                total_chips=e.total_chips,
            ),
            estimated=dict(
                decode_step_s=e.decode_step_s,
                prefill=dict(width=e.prefill_width, estimated_s=e.prefill_s),
                train_widths=widths,
                grad_sum_s=e.grad_sum_s,
                optimizer_update_s=e.optimizer_update_s,
            ),
            derived=dict(
                decode_t0_s=costs.decode.t0_s,
                decode_t1_s=costs.decode.t1_s,
                prefill_s_per_token=costs.prefill_s_per_token,
                padding_factor=round(self.train.padding_factor, 4),
                train_slice_s_per_position=self.train.s_per_position,
                train_slice_s_per_token=self.train.s_per_token,
                recompute_slice_s_per_token=self.train.recompute_s_per_token,
                train_chip_s_per_token=costs.train_s_per_token,
                train_fixed_s=costs.train_fixed_s,
                weight_bytes=e.weight_bytes,
                weight_load_s=costs.weight_load_s,
                kv_bytes_per_token=round(costs.kv_bytes_per_token, 1),
            ),
            assumed=dict(
                weight_load_bytes_per_s=self.weight_load_bytes_per_s,
                migrate_bytes_per_s=self.migrate_bytes_per_s,
                prompt_tokens=w.prompt_tokens,
                median_response=w.median_response,
                max_over_median=w.max_over_median,
            ),
            how=MAPPING,
        )


# ------------------------------------------------------------------------- reading compile.json
def read_compile_json(paths: Sequence[str]) -> tuple[dict, dict[str, tuple[str, dict]]]:
    """(the run config, {role: (file, role record)}) from one or more compile.json files of one config."""
    if not paths:
        raise ValueError("no compile.json given (--compile=DIR/compile.json)")
    config, first, roles = None, None, {}
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: cannot read a compile.json ({err})") from None
        for key in ("config", "roles"):
            if key not in data:
                raise ValueError(f"{path}: no '{key}' key; expected `python -m dora_jax.tpu_compile` output")
        if config is None:
            config, first = data["config"], path
        elif data["config"] != config:
            raise ValueError(f"{path} and {first} were compiled from different configs; project one config at a time")
        for role in data["roles"]:
            if role["role"] in roles:
                raise ValueError(f"{path}: role '{role['role']}' is also in {roles[role['role']][0]}")
            roles[role["role"]] = (path, role)
    return config, roles


def _get(tree: Mapping, dotted: str, path: str) -> Any:
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise ValueError(f"{path}: no '{dotted}' in the compile.json's config")
        node = node[part]
    return node


def _sampler_logps(config: Mapping) -> bool:
    """trainer.behaviour_logps = "sampler" in a compile.json's config (absent in files written before
    that option: "trainer")."""
    return config.get("trainer", {}).get("behaviour_logps", "trainer") == "sampler"


def _role(roles: dict, name: str, paths: Sequence[str]) -> tuple[str, dict]:
    if name not in roles:
        have = ", ".join(f"{r} ({p})" for r, (p, _) in roles.items()) or "none"
        raise ValueError(
            f"no compile.json among {list(paths)} has the {name} role (have: {have}); compile it with "
            f"`python -m dora_jax.tpu_compile --config=CONFIG --roles={name} --out=DIR`"
        )
    return roles[name]


def _estimated_s(program: dict, path: str, role: str) -> float:
    if "error" in program:
        raise ValueError(f"{path}: {role} program '{program['name']}' failed to compile: {program['error'][:200]}")
    seconds = program.get("estimated_s")
    if seconds is None:
        raise ValueError(f"{path}: {role} program '{program['name']}' has no estimate ({program.get('estimate')})")
    return float(seconds)


def _program(record: dict, name: str, path: str) -> dict:
    for program in record["programs"]:
        if program["name"] == name:
            return program
    raise ValueError(f"{path}: the {record['role']} role has no program '{name}'")


def _train_widths(record: dict, path: str, recomputes: bool = True) -> tuple[TrainWidth, ...]:
    """One TrainWidth per T with both a grad and a recompute program; null estimates scaled by model
    flops. `recomputes=False` (trainer.behaviour_logps = "sampler": the trainer never recomputes,
    and compiles no recompute program): grad programs alone, at no recompute cost."""
    kinds = ("grad", "recompute") if recomputes else ("grad",)
    found: dict[str, dict[int, dict]] = {kind: {} for kind in kinds}
    for program in record["programs"]:
        m = _TRAIN_PROGRAM.match(program["name"])
        if m and m.group(1) in found:
            found[m.group(1)][int(m.group(3))] = dict(program, rows=int(m.group(2)))
    for kind, by_width in found.items():
        if not by_width:
            raise ValueError(
                f"{path}: the trainer role has no {kind}[rows=R,T=T] program (a config with trainer.length_bucket > 0)"
            )
    if recomputes and set(found["grad"]) != set(found["recompute"]):
        grad, recompute = sorted(found["grad"]), sorted(found["recompute"])
        raise ValueError(f"{path}: grad widths {grad} != recompute widths {recompute}")
    seconds = {}
    for kind, by_width in found.items():
        estimated = [p for p in by_width.values() if p.get("estimated_s") is not None]
        if not estimated:
            raise ValueError(
                f"{path}: no {kind}[...] program has an estimate; compile with --estimate_lengths=T for some width T"
            )
        # Seconds per model flop of the estimated widths: the others run at the same MFU.
        rate = sum(p["estimated_s"] for p in estimated) / sum(_model_flops(p, path) for p in estimated)
        seconds[kind] = {
            T: (p["estimated_s"] if p.get("estimated_s") is not None else rate * _model_flops(p, path))
            for T, p in by_width.items()
        }
    return tuple(
        TrainWidth(
            width=T,
            grad_rows=found["grad"][T]["rows"],
            grad_s=seconds["grad"][T],
            recompute_rows=found["recompute"][T]["rows"] if recomputes else found["grad"][T]["rows"],
            recompute_s=seconds["recompute"][T] if recomputes else 0.0,
            estimated=all(found[kind][T].get("estimated_s") is not None for kind in kinds),
        )
        for T in sorted(found["grad"])
    )


def _model_flops(program: dict, path: str) -> float:
    if not program.get("model_flops"):
        raise ValueError(f"{path}: trainer program '{program['name']}' has no model_flops to scale an estimate by")
    return float(program["model_flops"])


def read_estimates(config: dict, roles: dict, paths: Sequence[str]) -> Estimates:
    """The programs and sizes the cost model needs, with errors naming the file and the missing key."""
    trainer_path, trainer = _role(roles, "trainer", paths)
    rollout_path, rollout = _role(roles, "rollout", paths)
    where = trainer_path
    if _get(config, "mesh.time_shared", where):
        raise ValueError(f"{where}: mesh.time_shared=True (roles share chips); the projection models separate slices")
    if not _get(config, "trainer.length_bucket", where):
        raise ValueError(f"{where}: trainer.length_bucket=0; the projection reads bucketed grad[rows=R,T=T] programs")
    prefills = {
        int(m.group(1)): p for p in rollout["programs"] for m in [_PREFILL_PROGRAM.match(p["name"])] if m is not None
    }
    if not prefills:
        raise ValueError(f"{rollout_path}: the rollout role has no prefill[T=..] program")
    prefill_width = max(prefills)
    for key in ("params", "decode_state"):
        if key not in rollout.get("resident_breakdown", {}):
            raise ValueError(f"{rollout_path}: the rollout role's resident_breakdown has no '{key}'")
    return Estimates(
        sources=tuple(paths),
        name=str(_get(config, "pod.name", where)),
        trainer_type=str(_get(config, "pod.trainer_type", where)),
        # A single-host pod (layout single_host) has no rollout type: its slices split the host's chips.
        rollout_type=str(
            _get(config, "pod.rollout_type", where) or f"part of {_get(config, 'pod.trainer_type', where)}"
        ),
        trainer_chips=int(trainer["chips"]),
        rollout_chips=int(rollout["chips"]),
        rollout_slices=int(_get(config, "rollout.num_slices", where)),
        slots=int(_get(config, "rollout.slots", where)),
        cache_length=int(_get(config, "rollout.cache_length", where)),
        decode_step_s=_estimated_s(_program(rollout, "generate", rollout_path), rollout_path, "rollout"),
        prefill_width=prefill_width,
        prefill_s=_estimated_s(prefills[prefill_width], rollout_path, "rollout"),
        train_widths=_train_widths(trainer, trainer_path, recomputes=not _sampler_logps(config)),
        grad_sum_s=_estimated_s(_program(trainer, "grad_sum", trainer_path), trainer_path, "trainer"),
        optimizer_update_s=_estimated_s(_program(trainer, "optimizer_update", trainer_path), trainer_path, "trainer"),
        num_updates=int(_get(config, "trainer.num_updates", where)),
        length_bucket=int(_get(config, "trainer.length_bucket", where)),
        rollout_param_bytes=int(rollout["resident_breakdown"]["params"]),
        decode_state_bytes=int(rollout["resident_breakdown"]["decode_state"]),
    )


# ------------------------------------------------------------------------------- the mapping
def bucket_positions(lengths: np.ndarray, pad_to: int, cap: int) -> np.ndarray:
    """Positions each row is padded to: the smallest pad_to x 2^k >= length, at most `cap`
    (as `dora_jax.trainer.batching.bucket_length`; rows alone: a micro-batch pads every row
    to the bucket of its longest, so this is a lower bound on the padding)."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.size and lengths.max() > cap:
        raise ValueError(f"a sample of {lengths.max()} tokens is longer than rollout.cache_length={cap}")
    doublings = np.ceil(np.log2(np.maximum(lengths, 1) / pad_to)).clip(min=0).astype(np.int64)
    return np.minimum(pad_to * 2**doublings, cap)


def train_cost(estimates: Estimates, lengths: np.ndarray) -> TrainCost:
    """The trainer's cost over samples of `lengths` (prompt + response) tokens, each padded to its
    bucket T and costing T x `TrainWidth.s_per_position` there."""
    lengths = np.asarray(lengths, np.int64)
    padded = bucket_positions(lengths, estimates.length_bucket, estimates.cache_length)
    seconds = recompute = 0.0
    for T, n in zip(*np.unique(padded, return_counts=True)):
        width = estimates.width(int(T))
        seconds += int(n) * int(T) * width.s_per_position(estimates.grad_sum_s)
        recompute += int(n) * width.recompute_s / width.recompute_rows
    tokens, positions = float(lengths.sum()), float(padded.sum())
    return TrainCost(
        s_per_token=seconds / tokens,
        recompute_s_per_token=recompute / tokens,
        padding_factor=positions / tokens,
        s_per_position=seconds / positions,
    )


def project_workload(config: dict, shape: WorkloadSpec, prompt_tokens: int, where: str) -> WorkloadSpec:
    """The config's batch: TBS / G prompts of G samples, its prompt budget (or
    `prompt_tokens` > 0), responses of `shape`'s distribution scaled to `rollout.max_new_tokens`."""
    group = int(_get(config, "coordinator.group_size", where))
    tbs = int(_get(config, "coordinator.train_batch_size", where))
    max_new = int(_get(config, "rollout.max_new_tokens", where))
    prompt = prompt_tokens or int(_get(config, "task.source.max_prompt_tokens", where))
    cache = int(_get(config, "rollout.cache_length", where))
    if prompt + max_new > cache:
        raise ValueError(
            f"{where}: prompt_tokens={prompt} + rollout.max_new_tokens={max_new} > rollout.cache_length={cache}"
        )
    return dataclasses.replace(
        shape,
        prompts_per_step=tbs // group,
        samples_per_prompt=group,
        prompt_tokens=prompt,
        median_response=max_new * shape.median_response / shape.max_response,
        max_response=max_new,
    )


def sample_lengths(workload: WorkloadSpec) -> np.ndarray:
    """Prompt + response tokens of a fixed stream of samples (as `mean_response` draws them)."""
    prompts = max(1, _LENGTH_DRAWS // workload.samples_per_prompt)
    responses = draw_lengths(workload, np.random.default_rng(12345), prompts)
    return workload.prompt_tokens + responses.ravel()


def project(sim_config, paths: Sequence[str]) -> Projection:
    """The projection of the config the compile.json files were compiled from.

    `sim_config` (configs/sim_paper.py) gives the response-length shape, the run options (modes,
    steps, warm-up, chunking, coordinator tick) and the `projection` constants; the pod, the
    batch, K, RBS and the rebalance period are the compiled config's.
    """
    base = from_config(sim_config)  # validates the sim config's own fields
    config, roles = read_compile_json(paths)
    estimates = read_estimates(config, roles, paths)
    where = estimates.sources[0]
    p = sim_config.projection
    for field in ("weight_load_bytes_per_s", "migrate_bytes_per_s"):
        if not p[field] > 0:
            raise ValueError(f"projection.{field}={p[field]}; expected > 0 bytes/s")
    workload = project_workload(config, base.workload, int(p.prompt_tokens), where)
    train = train_cost(estimates, sample_lengths(workload))
    costs = CostModel(
        accelerators_per_group=estimates.rollout_chips,
        slots_per_group=estimates.slots,
        decode=DecodeModel(t0_s=estimates.decode_step_s, t1_s=0.0),
        prefill_s_per_token=estimates.prefill_s / estimates.prefill_width,
        weight_load_s=estimates.weight_bytes / p.weight_load_bytes_per_s,
        kv_bytes_per_token=estimates.kv_bytes_per_token,
        migrate_bytes_per_s=float(p.migrate_bytes_per_s),
        train_s_per_token=train.s_per_token * estimates.trainer_chips,  # chip-seconds, as ClusterSpec counts them
        train_fixed_s=estimates.num_updates * estimates.optimizer_update_s,
    )
    tbs = int(_get(config, "coordinator.train_batch_size", where))
    options = dataclasses.replace(
        base.options,
        k_max=int(_get(config, "coordinator.k_max", where)),
        rbs_factor=int(_get(config, "coordinator.rollout_batch_size", where)) / tbs,
        rebalance_period_s=float(_get(config, "coordinator.rebalance_period_s", where)),
    )
    scenario = Scenario(
        workload=workload,
        costs=costs,
        options=options,
        # The pod's trainer slice is its own hardware: every mode runs split, sync included
        # (its rollout slices idle while the trainer runs, and the trainer while they roll out).
        placements=Placements(
            by_mode={m: Placement.SPLIT for m in Mode},
            node_size=estimates.rollout_chips,
            train_accelerators=estimates.trainer_chips,
            train_fraction=0.0,
        ),
        settings=(estimates.total_chips,),
        sweep_accelerators=(),
        sweep_steps=base.sweep_steps,
        sweep_warmup=base.sweep_warmup,
        sweep_batch_scaling=base.sweep_batch_scaling,
        paper={},
    )
    return Projection(
        estimates=estimates,
        train=train,
        weight_load_bytes_per_s=float(p.weight_load_bytes_per_s),
        migrate_bytes_per_s=float(p.migrate_bytes_per_s),
        scenario=scenario,
    )


# --------------------------------------------------------------------------------- the notes
def notes(projection: Projection, results: dict) -> list[str]:
    """Plain-language notes for a projection's results.json; every number read from the inputs."""
    e, sc = projection.estimates, projection.scenario
    w, costs = sc.workload, sc.costs
    train = projection.train
    tokens = w.batch_samples * (w.prompt_tokens + mean_response(w))
    sync_extra = tokens * train.recompute_s_per_token / e.num_updates
    estimated = [t.width for t in e.train_widths if t.estimated]
    per_flop = _flops_spread(e)
    out = [
        f"{LABEL}: {e.name} on {e.trainer_type} ({e.trainer_chips} chips, trainer) + {e.rollout_slices} x "
        f"{e.rollout_type} ({e.rollout_chips} chips each, rollout); every mode is the shipped coordinator on "
        f"the simulator's virtual clock. Host work, data loading, reward, collectives XLA does not overlap "
        f"as it assumes, and the coordinator's network hops are not in the estimates.",
        f"Decode: every step costs {1e3 * costs.decode.t0_s:.2f} ms (XLA's `generate`: one fixed-shape step "
        f"over all {e.slots} slots with a dense {e.cache_length}-token cache), whatever the number of active "
        f"slots: t1 = 0 is today's engine, so a long tail on few slots costs full steps.",
        f"Train: {costs.train_s_per_token / e.trainer_chips * 1e6:.2f} us of the {e.trainer_chips}-chip slice per "
        f"trained token = {1e6 * train.s_per_position:.2f} us per padded position x padding "
        f"{train.padding_factor:.2f} (length buckets of {e.length_bucket} x 2^k, rows alone: a lower "
        f"bound); XLA estimated width(s) {estimated}, the others scaled at the same seconds per model flop "
        f"(model flops per position vary {per_flop} across widths). Fixed per step: {e.num_updates} x "
        f"optimizer_update = {costs.train_fixed_s:.3f} s.",
        (
            f"Recompute is charged on every row; sync's first update takes its rows' behaviour log-probs from "
            f"its own forward, so sync's step is overstated by ~{sync_extra:.1f} s (recompute / "
            f"num_updates={e.num_updates})."
            if any(t.recompute_s for t in e.train_widths)
            else "No recompute is charged: trainer.behaviour_logps=sampler (every row's behaviour log-probs "
            "are its sampling log-probs; the trainer compiles no recompute program)."
        ),
        f"Assumed bandwidths (sim config `projection`): a version load moves {e.weight_bytes / 1e9:.1f} GB per "
        f"rollout slice at {projection.weight_load_bytes_per_s / 1e9:g} GB/s = {costs.weight_load_s:.2f} s; a KV "
        f"migration moves {costs.kv_bytes_per_token / 1e3:.1f} KB per context token at "
        f"{projection.migrate_bytes_per_s / 1e9:g} GB/s. The trainer's publish of a version is not charged.",
        f"Workload: {w.prompts_per_step} prompts x {w.samples_per_prompt} samples per step (TBS "
        f"{w.batch_samples}), {w.prompt_tokens}-token prompts (the budget), log-normal responses of median "
        f"{w.median_response:.0f} (mean {mean_response(w):.0f}) capped at {w.max_response}, the batch's "
        f"expected longest {w.max_over_median:g} x the median (the paper scenario's shape), not measured lengths.",
    ]
    for n, setting in results["settings"].items():
        modes, ratios = setting["modes"], setting["ratios"]
        summary = "; ".join(
            f"{m} {v['step_time_s']:.1f} s/step, bubble {v['bubble_ratio']:.2f}, audit_ok={v['audit_ok']}"
            for m, v in modes.items()
        )
        out.append(f"{n} chips (estimated): {summary}; dora_vs_sync={ratios.get('dora_vs_sync')}.")
        d = modes.get(Mode.DORA.value)
        if d:
            out.append(
                f"{n} chips: dora's trainer waits {d['trainer_wait_s']:.0f} s per step, refused "
                f"{d['window_waits']} times by the version window (K = {d['staleness_bound']}) with a full "
                f"batch ready: the longest responses ({w.max_response} tokens x {1e3 * costs.decode.t0_s:.1f} ms "
                f"= {w.max_response * costs.decode.t0_s:.0f} s at most) outlast K steps."
            )
        ablation = setting.get("kv_reuse_ablation")
        if ablation:
            out.append(
                f"{n} chips: KV migration instead of re-prefill changes dora's step "
                f"{ablation['step_time_s_with_re_prefill']:.1f} s -> {ablation['step_time_s_with_kv_migration']:.1f} s "
                f"(rollout time saving {100 * ablation['rollout_time_saving']:.1f}%): at the assumed bandwidth a "
                f"token moves at {projection.migrate_bytes_per_s / costs.kv_bytes_per_token:,.0f}/s, prefill runs "
                f"at {1 / costs.prefill_s_per_token:,.0f}/s, but a migration pauses one request, a prefill the slice."
            )
    return out


def _flops_spread(e: Estimates) -> str:
    """The range of grad model flops per position across widths, relative to the estimated widths'."""
    per_position = {t.width: t.grad_s / (t.grad_rows * t.width) for t in e.train_widths}
    ref = np.mean([per_position[t.width] for t in e.train_widths if t.estimated])
    lo, hi = min(per_position.values()) / ref - 1, max(per_position.values()) / ref - 1
    return f"{100 * lo:+.0f}% to {100 * hi:+.0f}%" if not math.isclose(lo, hi) else "not at all"
