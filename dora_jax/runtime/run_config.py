"""Turns an experiment's ConfigDict into the frozen dataclasses each role takes, validated once.

Every error names the config field (`coordinator.train_batch_size`, `mesh.trainer`, ...) and what
was expected. Nothing downstream sees the ConfigDict.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from dora_jax.coordinator.coordinator import CoordinatorConfig
from dora_jax.core.modes import Mode
from dora_jax.core.records import SamplingParams
from dora_jax.models.config import ATTENTION_IMPLEMENTATIONS, REMAT_POLICIES
from dora_jax.parallel.sharding import MESH_AXES
from dora_jax.tasks import running_sums
from dora_jax.tasks.reward_shaping import RewardShaping, parse_reward_on_error
from dora_jax.tasks.sources import SourceConfig
from dora_jax.tasks.task import TaskConfig


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    hf_path: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    param_dtype: str
    # A fresh Qwen3-MoE (num_experts > 0; with hf_path, config.json decides): see dora_jax.models.moe.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_dispatch: str = "grouped"  # "dense" | "grouped" | "megablox" (dora_jax.models.moe)
    attention: str = "auto"  # the full forward's kernel (dora_jax.models.attention)
    remat: str = "none"  # "none" | "dots" | "full": what the backward pass recomputes (ModelConfig.remat)
    scan_layers: bool = False  # the full forward's blocks as one lax.scan (ModelConfig.scan_layers)


@dataclasses.dataclass(frozen=True)
class InitSpec:
    checkpoint: str
    sft_steps: int
    sft_batch_size: int
    sft_lr: float


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    num_slices: int
    slots: int
    cache_length: int
    max_prefill_length: int
    sampling: SamplingParams
    max_new_tokens: int
    heartbeat_timeout_s: float = 120.0  # a slice silent this long is declared dead
    max_rejoins: int = 2  # times a slice whose worker raised is restarted
    weights_transfer: bool = False  # role processes: versions device to device (dora_jax/transport/weights.py)
    page_size: int = 0  # paged KV cache: rows per page (0 = dense, every slot holds cache_length rows)
    kv_pages: int = 0  # pages in the pool (0 = kv_memory_fraction of the chip memory left after the weights)
    kv_memory_fraction: float = 0.8
    migration: str = "auto"  # how a migrated in-flight request moves: "auto" (the cheaper), "kv", "reprefill"
    kv_link_bytes_per_s: float = 0.0  # the slices' link before a KV move is measured (0: unknown)
    # smallest prefill bucket, a power of two (0: the page size, at least 16); fewer buckets, fewer
    # programs to compile, at the cost of padding short prompts to it
    min_prefill_bucket: int = 0

    def migration_costs(self):
        """A slice's migration rule (dora_jax.rollout.migration.MigrationCosts), fresh per worker:
        it learns the link's rate from its own imports."""
        from dora_jax.rollout.migration import MigrationCosts

        return MigrationCosts(policy=self.migration, link_bytes_per_s=self.kv_link_bytes_per_s)

    def engine_config(self):
        """Every rollout slice's engine sizes (dora_jax.rollout.engine.EngineConfig, imported here:
        it pulls in JAX), with top-k/top-p filtering compiled in only when the run samples with it."""
        from dora_jax.rollout.engine import EngineConfig

        s = self.sampling
        return EngineConfig(
            num_slots=self.slots,
            cache_length=self.cache_length,
            max_prefill_length=self.max_prefill_length,
            sampling_filters=s.top_k > 0 or s.top_p < 1,
            # Prefixes are written page by page: the smallest bucket holds whole pages.
            min_prefill_bucket=min(self.min_prefill_bucket or max(16, self.page_size), self.max_prefill_length),
            page_size=self.page_size,
            num_pages=self.kv_pages,
            kv_memory_fraction=self.kv_memory_fraction,
        )


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    trainer: tuple[tuple[str, int], ...]
    rollout: tuple[tuple[str, int], ...]
    time_shared: bool
    fake_cpu_devices: int


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """Evaluation during training (dora_jax.coordinator.evaluation): at version 0, every
    `every_steps` steps and at the last step, `num_prompts` held-out prompts, each answered once
    greedily and `samples` times at the run's sampling settings (pass@k with k = samples)."""

    every_steps: int = 0  # 0 = no evaluation
    num_prompts: int = 128
    samples: int = 4
    path: str = ""  # an eval file (the task's field mapping); "" = held out from the task's own source
    final_timeout_s: float = 600.0  # how long the run waits for the last round after its last step

    @property
    def enabled(self) -> bool:
        return self.every_steps > 0

    def due(self, version: int, num_steps: int) -> bool:
        """Whether `version` (params after that many steps) is evaluated."""
        return self.enabled and (version % self.every_steps == 0 or version == num_steps)


@dataclasses.dataclass(frozen=True)
class LogSpec:
    tensorboard: bool = True
    wandb: bool = False  # Weights & Biases (the `wandb` extra)
    wandb_project: str = "dora_jax"
    wandb_name: str = ""  # "" = wandb's generated name
    wandb_tags: tuple[str, ...] = ()
    wandb_mode: str = "online"  # online | offline (no network; `wandb sync` later) | disabled


@dataclasses.dataclass(frozen=True)
class RunConfig:
    mode: str
    num_steps: int
    seed: int
    model: ModelSpec
    init: InitSpec
    task: ml_collections.FrozenConfigDict
    mesh: MeshSpec
    rollout: RolloutSpec
    coordinator: CoordinatorConfig
    trainer: object  # dora_jax.trainer.TrainerConfig (imported lazily: it pulls in JAX)
    pad_to: int
    checkpoint_every: int
    checkpoint_keep: int
    tensorboard: bool
    eval: EvalSpec = EvalSpec()
    log: LogSpec = LogSpec()
    # task.overlong_penalty_tokens and task.reward_on_error, with rollout.max_new_tokens as L_max
    reward_shaping: RewardShaping = RewardShaping()


def _mesh_shape(group: ml_collections.ConfigDict, field: str) -> tuple[tuple[str, int], ...]:
    shape = dict(group)
    for axis, size in shape.items():
        if axis not in MESH_AXES:
            raise ValueError(f"{field} has axis {axis!r}; expected axes from {MESH_AXES}")
        if int(size) < 1:
            raise ValueError(f"{field}.{axis}={size}; expected >= 1")
    return tuple((axis, int(size)) for axis, size in shape.items())


def parse(c: ml_collections.ConfigDict, *, trainer_config_cls=None) -> RunConfig:
    """Validates and converts. `trainer_config_cls` defaults to dora_jax.trainer.TrainerConfig."""
    if trainer_config_cls is None:
        from dora_jax.trainer import TrainerConfig as trainer_config_cls
    try:
        mode = Mode(c.mode).value
    except ValueError:
        raise ValueError(f"mode={c.mode!r}; expected one of {[m.value for m in Mode]}") from None
    if c.num_steps < 1:
        raise ValueError(f"num_steps={c.num_steps}; expected >= 1")
    r = c.rollout
    sampling = SamplingParams(temperature=float(r.temperature), top_p=float(r.top_p), top_k=int(r.top_k))
    rollout = RolloutSpec(
        int(r.num_slices),
        int(r.slots),
        int(r.cache_length),
        int(r.max_prefill_length),
        sampling,
        int(r.max_new_tokens),
        float(r.get("heartbeat_timeout_s", 120.0)),
        int(r.get("max_rejoins", 2)),
        bool(r.get("weights_transfer", False)),
        int(r.get("page_size", 0)),
        int(r.get("kv_pages", 0)),
        float(r.get("kv_memory_fraction", 0.8)),
        str(r.get("migration", "auto")),
        float(r.get("kv_link_bytes_per_s", 0.0)),
        int(r.get("min_prefill_bucket", 0)),
    )
    smallest = rollout.min_prefill_bucket
    if smallest and (smallest < max(1, rollout.page_size) or smallest & (smallest - 1)):
        raise ValueError(
            f"rollout.min_prefill_bucket={smallest}; expected 0 (the page size) or a power of two >= "
            f"rollout.page_size={rollout.page_size}"
        )
    rollout.migration_costs()  # a bad policy or rate fails here, naming the field
    if rollout.heartbeat_timeout_s <= 0:
        raise ValueError(f"rollout.heartbeat_timeout_s={rollout.heartbeat_timeout_s}; expected > 0")
    if int(c.checkpoint.get("keep", 3)) < 1:
        raise ValueError(f"checkpoint.keep={c.checkpoint.keep}; expected >= 1 (checkpoints to keep)")
    if rollout.max_new_tokens >= rollout.cache_length:
        raise ValueError(
            f"rollout.max_new_tokens={rollout.max_new_tokens} must be < rollout.cache_length={rollout.cache_length}"
        )
    k = c.coordinator
    coordinator = CoordinatorConfig(
        mode=mode,
        k_max=int(k.k_max),
        rollout_batch_size=int(k.rollout_batch_size),
        train_batch_size=int(k.train_batch_size),
        group_size=int(k.group_size),
        max_new_tokens=rollout.max_new_tokens,
        sampling=sampling,
        seed=int(c.seed),
        rebalance_period_s=float(k.rebalance_period_s),
        legacy_fill=bool(k.legacy_fill),
        # DAPO's dynamic sampling is the trainer's setting; the coordinator does the filtering and refilling
        dynamic_sampling=bool(c.trainer.get("dynamic_sampling", False)),
        max_filtered_batches_per_step=int(k.get("max_filtered_batches_per_step", 10)),
        # the filter counts a failed grade as the trainer does (task.reward_on_error; "mask": not at all)
        reward_on_error=parse_reward_on_error(c.task.get("reward_on_error", 0.0)),
    )
    coordinator.validate(rollout.num_slices)
    t = dict(c.trainer)
    pad_to = int(t.pop("pad_to"))
    if t.get("tis_cap") == 0:
        t["tis_cap"] = None
    if "temperature" in t:
        raise ValueError(
            f"trainer.temperature={t['temperature']}; not a config field: the trainer takes rollout.temperature"
        )
    # The trainer's log-probs are of the distribution the rollout samples (greedy rows: the raw logits).
    t["temperature"] = sampling.temperature if sampling.temperature > 0 else 1.0
    trainer = trainer_config_cls(**t)
    _check_truncated_sampling(sampling, trainer.truncated_sampling_ratio)
    rows = trainer.micro_batch_size * trainer.num_updates
    if coordinator.train_batch_size % rows:
        raise ValueError(
            f"coordinator.train_batch_size={coordinator.train_batch_size} must be a multiple of "
            f"trainer.micro_batch_size * trainer.num_updates = {rows}"
        )
    mesh = MeshSpec(
        _mesh_shape(c.mesh.trainer, "mesh.trainer"),
        _mesh_shape(c.mesh.rollout, "mesh.rollout"),
        bool(c.mesh.time_shared),
        int(c.mesh.fake_cpu_devices),
    )
    m = c.model
    model = ModelSpec(
        str(m.hf_path),
        int(m.num_layers),
        int(m.hidden_size),
        int(m.intermediate_size),
        int(m.num_heads),
        int(m.num_kv_heads),
        int(m.head_dim),
        str(m.dtype),
        str(m.param_dtype),
        num_experts=int(m.get("num_experts", 0)),
        num_experts_per_tok=int(m.get("num_experts_per_tok", 0)),
        moe_intermediate_size=int(m.get("moe_intermediate_size", 0)),
        norm_topk_prob=bool(m.get("norm_topk_prob", False)),
        moe_dispatch=str(m.get("moe_dispatch", "grouped")),
        attention=str(m.get("attention", "auto")),
        remat=str(m.get("remat", "none")),
        scan_layers=bool(m.get("scan_layers", False)),
    )
    from dora_jax.models.config import MOE_DISPATCHES

    if model.moe_dispatch not in MOE_DISPATCHES:
        raise ValueError(f"model.moe_dispatch={model.moe_dispatch!r}; expected one of {MOE_DISPATCHES}")
    if model.attention not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"model.attention={model.attention!r}; expected one of {ATTENTION_IMPLEMENTATIONS}")
    if model.remat not in REMAT_POLICIES:
        raise ValueError(f"model.remat={model.remat!r}; expected one of {REMAT_POLICIES}")
    e = c.get("eval") or {}
    evaluation = EvalSpec(
        int(e.get("every_steps", 0)),
        int(e.get("num_prompts", 128)),
        int(e.get("samples", 4)),
        str(e.get("path", "")),
        float(e.get("final_timeout_s", 600.0)),
    )
    for field, value, low in (("every_steps", evaluation.every_steps, 0), ("samples", evaluation.samples, 0)):
        if value < low:
            raise ValueError(f"eval.{field}={value}; expected >= {low}")
    if evaluation.enabled and evaluation.num_prompts < 1:
        raise ValueError(f"eval.num_prompts={evaluation.num_prompts}; expected >= 1 when eval.every_steps > 0")
    g = c.log
    log = LogSpec(
        bool(g.tensorboard),
        bool(g.get("wandb", False)),
        str(g.get("wandb_project", "dora_jax")),
        str(g.get("wandb_name", "")),
        tuple(str(t) for t in (g.get("wandb_tags") or ())),
        str(g.get("wandb_mode", "online")),
    )
    if log.wandb_mode not in ("online", "offline", "disabled"):
        raise ValueError(f"log.wandb_mode={log.wandb_mode!r}; expected 'online', 'offline' or 'disabled'")
    i = c.init
    init = InitSpec(str(i.checkpoint), int(i.sft_steps), int(i.sft_batch_size), float(i.sft_lr))
    shaping = RewardShaping(
        max_response_tokens=rollout.max_new_tokens,
        overlong_penalty_tokens=int(c.task.get("overlong_penalty_tokens", 0)),
        reward_on_error=parse_reward_on_error(c.task.get("reward_on_error", 0.0)),
    )
    return RunConfig(
        mode=mode,
        num_steps=int(c.num_steps),
        seed=int(c.seed),
        model=model,
        init=init,
        task=ml_collections.FrozenConfigDict(c.task),
        mesh=mesh,
        rollout=rollout,
        coordinator=coordinator,
        trainer=trainer,
        pad_to=pad_to,
        checkpoint_every=int(c.checkpoint.every_steps),
        checkpoint_keep=int(c.checkpoint.get("keep", 3)),
        tensorboard=bool(c.log.tensorboard),
        eval=evaluation,
        log=log,
        reward_shaping=shaping,
    )


def _check_truncated_sampling(sampling: SamplingParams, treatment: str) -> None:
    """A training run that samples with top-p/top-k says how its ratio treats the truncation
    (trainer.truncated_sampling_ratio): engine and trainer both give log-probs of the untruncated
    temperature-scaled distribution, which is not the one a filtered token was drawn from."""
    if treatment == "refuse" and (sampling.top_p < 1 or sampling.top_k > 0):
        raise ValueError(
            f"rollout.top_p={sampling.top_p}, rollout.top_k={sampling.top_k}: a training run that samples "
            "from a truncated distribution must say how the importance ratio treats it; expected rollout.top_p=1 "
            "and rollout.top_k=0, or trainer.truncated_sampling_ratio='ignore' (the ratio then uses the "
            "untruncated temperature-scaled distribution; docs/dapo.md)"
        )


def task_config(config: RunConfig) -> TaskConfig:
    t = config.task
    # task.fallback_last_number: grade an answer-less response by its last number (gsm8k / math
    # rewards only; TaskConfig refuses it for running_sums). Absent = False.
    fallback_last_number = bool(t.get("fallback_last_number", False))
    if t.kind == "running_sums":
        rs = running_sums.RunningSumsConfig(
            median_k=t.median_k, sigma=t.sigma, k_max=t.k_max, max_term=int(t.get("max_term", 2)), seed=config.seed
        )
        return TaskConfig(kind="running_sums", running_sums=rs, fallback_last_number=fallback_last_number)
    fields = {k: v for k, v in t.source.items()}
    if config.eval.enabled and not config.eval.path:
        fields["hold_out"] = config.eval.num_prompts  # the eval prompts come from the file's last rows
    source = SourceConfig(**fields, seed=config.seed)
    return TaskConfig(kind=t.kind, source=source, fallback_last_number=fallback_last_number)
