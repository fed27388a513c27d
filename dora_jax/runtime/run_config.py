"""Turns an experiment's ConfigDict into the frozen dataclasses each role takes, validated once.

The schema is the spec dataclasses: each section of a config file (`model`, `rollout`, `trainer`,
...) is read field by field from the dataclasses in `SECTIONS`, and every field's type, default
and one-line description sit on the field itself (`setting(help, default)`). `parse` is generic
over them: a config sets only what differs from the defaults, a field the schema does not know is
refused by name with the nearest known one (`trainer.lrr: unknown field; did you mean
trainer.lr?`), and a value of the wrong type is refused naming the field, the value and the type
expected. Then the checks that span fields run. Every error names the config field.

Three sections are read into dataclasses owned elsewhere (`rollout`'s sampling fields into
`SamplingParams`, `coordinator` into `CoordinatorConfig`, `trainer` into `TrainerConfig`): their
types, defaults and descriptions are on those classes' fields (dora_jax.core.schema.setting), as
they are on the spec dataclasses here.

    python -m dora_jax.runtime.run_config   # every field: type, default, description

Nothing downstream sees the ConfigDict (but `task`, handed on as written for dora_jax.tasks).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping

import ml_collections

from dora_jax.coordinator.coordinator import CoordinatorConfig
from dora_jax.core.modes import Mode
from dora_jax.core.records import SamplingParams
from dora_jax.core.schema import REQUIRED, setting
from dora_jax.models.config import ATTENTION_IMPLEMENTATIONS, MOE_DISPATCHES, REMAT_POLICIES
from dora_jax.parallel.sharding import MESH_AXES
from dora_jax.tasks import running_sums
from dora_jax.tasks.reward_shaping import RewardShaping, parse_reward_on_error
from dora_jax.tasks.sources import SourceConfig
from dora_jax.tasks.task import DEFAULT_REWARD, TaskConfig

MeshShape = tuple[tuple[str, int], ...]  # written in a config as a group: {"fsdp": 2}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """The config's top-level fields (RunConfig.mode, .num_steps, .seed)."""

    num_steps: int = setting("training steps (= versions published)")
    mode: str = setting("sync | one_step_off | partial_rollout | dora", "dora")
    seed: int = setting("model init, prompt order, sampling seeds", 0)
    compile_ahead: bool = setting(
        "every role compiles each program it can run before the run starts (no compile mid-run; the "
        "migration rule's prefill times are measured then); False: each when first used (a faster start)",
        True,
    )


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    hf_path: str = setting('a HF checkpoint directory (its config.json decides the sizes); "" = a fresh model')
    num_layers: int = setting("decoder blocks")
    hidden_size: int = setting("embed width")
    intermediate_size: int = setting("SwiGLU width")
    num_heads: int = setting("query heads")
    num_kv_heads: int = setting("key/value heads (GQA)")
    head_dim: int = setting("per-head width")
    dtype: str = setting("compute dtype: float32 | bfloat16")
    param_dtype: str = setting("storage dtype of params (the trainer's master weights)")
    # A fresh Qwen3-MoE (num_experts > 0; with hf_path, config.json decides): see dora_jax.models.moe.
    num_experts: int = setting("> 0: a Qwen3-MoE with this many experts per layer", 0)
    num_experts_per_tok: int = setting("MoE: experts per token (top-k)", 0)
    moe_intermediate_size: int = setting("MoE: each expert's SwiGLU width", 0)
    norm_topk_prob: bool = setting("MoE: renormalise the top-k routing weights", False)
    moe_dispatch: str = setting(f"MoE computation, one of {MOE_DISPATCHES} (dora_jax.models.moe)", "grouped")
    attention: str = setting(f"the full forward's kernel, one of {ATTENTION_IMPLEMENTATIONS}", "auto")
    remat: str = setting(f"what the backward pass recomputes, one of {REMAT_POLICIES}", "none")
    scan_layers: bool = setting("the full forward's blocks as one lax.scan (one block compiled)", False)


@dataclasses.dataclass(frozen=True)
class InitSpec:
    checkpoint: str = setting('a HF checkpoint dir to start RL from; "" = model.hf_path, or an SFT cold start', "")
    sft_steps: int = setting("SFT updates of the cold start (running_sums without a checkpoint); 0 = none", 0)
    sft_batch_size: int = setting("demonstrations per SFT update", 32)
    sft_lr: float = setting("SFT learning rate (3e-3: the smoke model's)", 3e-3)


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """The `task` section. Checked against this schema, then handed on as written (RunConfig.task,
    read by dora_jax.tasks and the runner): its defaults are what those readers take when a field
    is absent."""

    kind: str = setting("running_sums | gsm8k | math")
    reward_workers: int = setting("reward processes")
    reward_timeout_s: float = setting("per-sample reward timeout, seconds")
    fallback_last_number: bool = setting("gsm8k / math: grade an answer-less response by its last number", False)
    overlong_penalty_tokens: int = setting("DAPO's L_cache: a length penalty over the last N tokens (0 = off)", 0)
    reward_on_error: float | str = setting('the reward of a sample whose grading failed, or "mask"', 0.0)
    median_k: float | None = setting("running_sums: median number of terms", None)
    sigma: float | None = setting("running_sums: log-normal shape of the number of terms", None)
    k_max: int | None = setting("running_sums: most terms in one prompt", None)
    max_term: int = setting("running_sums: terms are 0..max_term", 2)
    source: dict | None = setting("file tasks: the prompt file and its fields (tasks.sources.SourceConfig)", None)


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    num_slices: int = setting("rollout slices (data-parallel rollout groups)")
    slots: int = setting("concurrent decodes per slice")
    cache_length: int = setting("prompt + response tokens per slot")
    max_prefill_length: int = setting("largest prefill bucket (a power of two)")
    sampling: SamplingParams = setting("rollout.temperature, .top_p, .top_k (and the run's seed)")
    max_new_tokens: int = setting("response cap, tokens (< cache_length)")
    heartbeat_timeout_s: float = setting("a slice silent this long is declared dead", 120.0)
    max_rejoins: int = setting("times a slice whose worker raised is restarted", 2)
    weights_transfer: bool = setting("role processes: versions device to device (transport/weights.py)", False)
    page_size: int = setting("paged KV cache: rows per page (0 = dense: every slot holds cache_length rows)", 0)
    kv_pages: int = setting("pages in the pool (0 = kv_memory_fraction of the memory left after weights)", 0)
    kv_memory_fraction: float = setting("the pool's share of chip memory left after the weights", 0.8)
    migration: str = setting('how a migrated request moves: "auto" (the cheaper), "kv" or "reprefill"', "auto")
    kv_link_bytes_per_s: float = setting("the slices' link before a KV move is measured, bytes/s (0: unknown)", 0.0)
    min_prefill_bucket: int = setting(
        "smallest prefill bucket, a power of two (0: the page size, at least 16): fewer programs, more padding", 0
    )

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
    trainer: MeshShape = setting(f"the trainer slice's mesh shape, axes from {MESH_AXES}: {{'fsdp': 2}}")
    rollout: MeshShape = setting("each rollout slice's mesh shape: {'tensor': 1}")
    time_shared: bool = setting("allow slices to share devices (one Colab GPU / TPU core)", False)
    fake_cpu_devices: int = setting("on CPU only: XLA host devices to fake (0 = leave XLA_FLAGS alone)", 0)


@dataclasses.dataclass(frozen=True)
class TrainerSpec:
    """The `trainer` section's field that is not TrainerConfig's (RunConfig.pad_to)."""

    pad_to: int = setting("sequence lengths are padded to a multiple of this (bounded compiles)")


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
    """The `checkpoint` section (RunConfig.checkpoint_every, .checkpoint_keep)."""

    every_steps: int = setting("periodic checkpoints every N steps (0 = none; SIGTERM still saves one)", 0)
    keep: int = setting("newest checkpoints kept in WORKDIR/checkpoints", 3)


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """Evaluation during training (dora_jax.coordinator.evaluation): at version 0, every
    `every_steps` steps and at the last step, `num_prompts` held-out prompts, each answered once
    greedily and `samples` times at the run's sampling settings (pass@k with k = samples)."""

    every_steps: int = setting("evaluate at version 0, every N steps and at the last step (0 = off)", 0)
    num_prompts: int = setting("held-out prompts", 128)
    samples: int = setting("sampled responses per prompt (eval/pass@k), besides one greedy response", 4)
    path: str = setting("an eval file (the task's field mapping); \"\" = held out from the task's own source", "")
    final_timeout_s: float = setting("how long the run waits for the last round after its last step", 600.0)

    @property
    def enabled(self) -> bool:
        return self.every_steps > 0

    def due(self, version: int, num_steps: int) -> bool:
        """Whether `version` (params after that many steps) is evaluated."""
        return self.enabled and (version % self.every_steps == 0 or version == num_steps)


@dataclasses.dataclass(frozen=True)
class LogSpec:
    tensorboard: bool = setting("write TensorBoard events under WORKDIR/tb", True)
    wandb: bool = setting('also log to Weights & Biases (pip install -e ".[wandb]")', False)
    wandb_project: str = setting("the W&B project", "dora_jax")
    wandb_name: str = setting('the W&B run name; "" = wandb\'s generated name', "")
    wandb_tags: tuple[str, ...] = setting("the W&B run's tags", ())
    wandb_mode: str = setting("online | offline (no network; `wandb sync` later) | disabled", "online")


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
    compile_ahead: bool = True  # RunSpec.compile_ahead


# Descriptions of the fields of the dataclasses other modules own, by class name, while those carry
# no field metadata: the sampling fields of `rollout`, `coordinator` and `trainer`. Types and
# defaults are the classes' own.

# Fields of the dataclasses a section is read into that the run sets, not the config: a config
# that names one is told where its value comes from.
TAKEN_FROM = {
    "rollout.sampling": "rollout.temperature, rollout.top_p and rollout.top_k",
    "rollout.seed": "seed",
    "coordinator.mode": "mode",
    "coordinator.max_new_tokens": "rollout.max_new_tokens",
    "coordinator.sampling": "rollout.temperature, rollout.top_p and rollout.top_k",
    "coordinator.stop_ids": "the tokenizer",
    "coordinator.seed": "seed",
    "coordinator.vocab_size": "the model's vocabulary",
    "coordinator.dynamic_sampling": "trainer.dynamic_sampling",
    "coordinator.reward_on_error": "task.reward_on_error",
    "coordinator.behaviour_logps": "trainer.behaviour_logps",
    "trainer.temperature": "rollout.temperature",
    "task.source.seed": "seed",
    "task.source.hold_out": "eval.num_prompts (with eval on and no eval.path)",
}

# Top-level groups that other commands read and parse leaves alone.
OTHER_SECTIONS = {"pod": "launch/tpu.py", "bench": "dora_jax.bench"}


@dataclasses.dataclass(frozen=True)
class ConfigField:
    """One field of a config file: `section.name`, its type, its default (REQUIRED: none) and help."""

    section: str  # "" for the top-level fields
    name: str
    type: object
    default: object
    help: str

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}" if self.section else self.name


def _fields_of(section: str, cls) -> tuple[ConfigField, ...]:
    """The config fields `cls` reads from `section`: its dataclass fields less those TAKEN_FROM the run."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f"{section}.{f.name}" in TAKEN_FROM:
            continue
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        description = f.metadata.get("help", "")
        out.append(ConfigField(section, f.name, hints[f.name], default, description))
    return tuple(out)


def schema() -> dict[str, tuple[ConfigField, ...]]:
    """Every section of a config file ("" = the top level) and its fields, in order."""
    from dora_jax.trainer import TrainerConfig

    return {
        "": _fields_of("", RunSpec),
        "model": _fields_of("model", ModelSpec),
        "init": _fields_of("init", InitSpec),
        "task": _fields_of("task", TaskSpec),
        "mesh": _fields_of("mesh", MeshSpec),
        "rollout": _fields_of("rollout", RolloutSpec) + _fields_of("rollout", SamplingParams),
        "coordinator": _fields_of("coordinator", CoordinatorConfig),
        "trainer": _fields_of("trainer", TrainerSpec) + _fields_of("trainer", TrainerConfig),
        "checkpoint": _fields_of("checkpoint", CheckpointSpec),
        "eval": _fields_of("eval", EvalSpec),
        "log": _fields_of("log", LogSpec),
    }


def _is_group(value) -> bool:
    return isinstance(value, (Mapping, ml_collections.ConfigDict))


def _type_name(kind) -> str:
    """What a value of `kind` looks like, for an error message."""
    if kind == MeshShape:
        return "a group of mesh axis sizes, e.g. {'fsdp': 2}"
    if isinstance(kind, types.UnionType):
        return " or ".join(_type_name(member) for member in typing.get_args(kind))
    if typing.get_origin(kind) is tuple:
        item = typing.get_args(kind)[0]
        return "a sequence of " + {str: "strings", int: "ints", float: "numbers"}.get(item, _type_name(item))
    names = {bool: "True or False", int: "an int", float: "a number", str: "a string", dict: "a group"}
    return names.get(kind, "None" if kind is type(None) else getattr(kind, "__name__", str(kind)))


class _WrongType(Exception):
    pass


def _convert(value, kind, where: str):
    """`value` as a `kind` (an int as a float, a sequence as a tuple, a mesh group as MeshShape),
    or _WrongType."""
    if isinstance(kind, types.UnionType):
        for member in typing.get_args(kind):
            try:
                return _convert(value, member, where)
            except _WrongType:
                pass
        raise _WrongType
    if kind is type(None):
        if value is None:
            return None
    elif kind == MeshShape:
        if _is_group(value):
            return _mesh_shape(value, where)
    elif typing.get_origin(kind) is tuple:
        if isinstance(value, (list, tuple)):
            return tuple(_convert(item, typing.get_args(kind)[0], where) for item in value)
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is dict:
        if _is_group(value):
            return value
    elif kind in (bool, str):
        if isinstance(value, kind):
            return value
    else:
        return value  # not a config type (a nested dataclass is TAKEN_FROM the run)
    raise _WrongType


def _mesh_shape(group, field: str) -> MeshShape:
    shape = dict(group)
    for axis, size in shape.items():
        if axis not in MESH_AXES:
            raise ValueError(f"{field} has axis {axis!r}; expected axes from {MESH_AXES}")
        if not isinstance(size, int) or isinstance(size, bool):
            raise ValueError(f"{field}.{axis}={size!r}; expected an int")
        if size < 1:
            raise ValueError(f"{field}.{axis}={size}; expected >= 1")
    return tuple((axis, size) for axis, size in shape.items())


def _refuse_unknown(where: str, key: str, value, known) -> None:
    """A key the schema does not know: where its value comes from if the run sets it, else the
    nearest field's name."""
    if where in TAKEN_FROM:
        section = where.split(".")[0]
        raise ValueError(f"{where}={value!r}; not a config field: the {section} takes {TAKEN_FROM[where]}")
    near = difflib.get_close_matches(key, list(known), n=1)
    prefix = where[: -len(key)]
    hint = f"did you mean {prefix}{near[0]}?" if near else "see `python -m dora_jax.runtime.run_config`"
    raise ValueError(f"{where}: unknown field; {hint}")


def read_section(group, fields: tuple[ConfigField, ...], groups: frozenset[str] = frozenset()) -> dict:
    """The section's values by field name, converted, with the defaults of the fields it leaves out.
    Refuses an unknown key, a missing required field and a value of the wrong type, naming the field.
    `groups`: keys that are other sections (the top level's), passed over."""
    by_name = {f.name: f for f in fields}
    section = fields[0].section
    values = {}
    for key in group.keys() if group is not None else ():
        where = f"{section}.{key}" if section else key
        if key in groups:
            if group[key] is not None and not _is_group(group[key]):  # None: the section's defaults
                raise ValueError(f"{where}={group[key]!r}; expected a group of fields (a ConfigDict)")
            continue
        if key not in by_name:
            _refuse_unknown(where, key, group[key], [*by_name, *groups])
        field = by_name[key]
        try:
            values[key] = _convert(group[key], field.type, where)
        except _WrongType:
            raise ValueError(f"{where}={group[key]!r}; expected {_type_name(field.type)}") from None
    for field in fields:
        if field.name not in values:
            if field.default is REQUIRED:
                raise ValueError(f"{field.path}: missing; expected {_type_name(field.type)} ({field.help})")
            values[field.name] = field.default
    return values


def read(c: ml_collections.ConfigDict) -> dict[str, dict]:
    """Every section's values (read_section), by section name; "" holds the top-level fields."""
    sections = schema()
    groups = frozenset(sections) - {""} | frozenset(OTHER_SECTIONS)
    values = {"": read_section(c, sections[""], groups)}
    for name, fields in sections.items():
        if name:
            values[name] = read_section(c[name] if name in c else None, fields)
    return values


def parse(c: ml_collections.ConfigDict) -> RunConfig:
    """Reads every section against the schema (`read`), then checks what spans fields."""
    values = read(c)
    top, task = values[""], values["task"]
    mode = _mode(top)
    _check_task(task)
    rollout_values = values["rollout"]
    sampling = SamplingParams(**{name: rollout_values.pop(name) for name in ("temperature", "top_p", "top_k")})
    rollout = RolloutSpec(sampling=sampling, **rollout_values)
    _check_rollout(rollout)
    checkpoint = CheckpointSpec(**values["checkpoint"])
    if checkpoint.keep < 1:
        raise ValueError(f"checkpoint.keep={checkpoint.keep}; expected >= 1 (checkpoints to keep)")
    # the filter counts a failed grade as the trainer does (task.reward_on_error; "mask": not at all)
    reward_on_error = parse_reward_on_error(task["reward_on_error"])
    coordinator = CoordinatorConfig(
        mode=mode,
        max_new_tokens=rollout.max_new_tokens,
        sampling=sampling,
        seed=top["seed"],
        # DAPO's dynamic sampling is the trainer's setting; the coordinator does the filtering and refilling
        dynamic_sampling=values["trainer"]["dynamic_sampling"],
        reward_on_error=reward_on_error,
        behaviour_logps=values["trainer"]["behaviour_logps"],  # the ledger records each row's source
        **values["coordinator"],
    )
    coordinator.validate(rollout.num_slices)
    pad_to = values["trainer"].pop("pad_to")
    trainer = _trainer(values["trainer"], sampling)
    rows = trainer.micro_batch_size * trainer.num_updates
    if coordinator.train_batch_size % rows:
        raise ValueError(
            f"coordinator.train_batch_size={coordinator.train_batch_size} must be a multiple of "
            f"trainer.micro_batch_size * trainer.num_updates = {rows}"
        )
    model, evaluation, log = ModelSpec(**values["model"]), EvalSpec(**values["eval"]), LogSpec(**values["log"])
    _check_choices(model, log)
    _check_eval(evaluation)
    shaping = RewardShaping(
        max_response_tokens=rollout.max_new_tokens,
        overlong_penalty_tokens=task["overlong_penalty_tokens"],
        reward_on_error=reward_on_error,
    )
    return RunConfig(
        mode=mode,
        num_steps=top["num_steps"],
        seed=top["seed"],
        model=model,
        init=InitSpec(**values["init"]),
        task=ml_collections.FrozenConfigDict(c.task),
        mesh=MeshSpec(**values["mesh"]),
        rollout=rollout,
        coordinator=coordinator,
        trainer=trainer,
        pad_to=pad_to,
        checkpoint_every=checkpoint.every_steps,
        checkpoint_keep=checkpoint.keep,
        tensorboard=log.tensorboard,
        eval=evaluation,
        log=log,
        reward_shaping=shaping,
        compile_ahead=top["compile_ahead"],
    )


def _mode(top: dict) -> str:
    """The top-level fields' checks; the mode's value."""
    try:
        mode = Mode(top["mode"]).value
    except ValueError:
        raise ValueError(f"mode={top['mode']!r}; expected one of {[m.value for m in Mode]}") from None
    if top["num_steps"] < 1:
        raise ValueError(f"num_steps={top['num_steps']}; expected >= 1")
    return mode


def _trainer(values: dict, sampling: SamplingParams):
    """dora_jax.trainer.TrainerConfig from the trainer section (less pad_to) and the rollout's sampling."""
    from dora_jax.trainer import TrainerConfig

    if values["tis_cap"] == 0:
        values["tis_cap"] = None
    # The trainer's log-probs are of the distribution the rollout samples (greedy rows: the raw logits).
    trainer = TrainerConfig(temperature=sampling.temperature if sampling.temperature > 0 else 1.0, **values)
    _check_truncated_sampling(sampling, trainer.truncated_sampling_ratio)
    return trainer


def _check_task(task: dict) -> None:
    """The task section's fields that depend on its kind (the section itself is handed on as written)."""
    if task["kind"] not in DEFAULT_REWARD:
        raise ValueError(f"task.kind={task['kind']!r}; expected one of {sorted(DEFAULT_REWARD)}")
    if task["kind"] == "running_sums":
        for name in ("median_k", "sigma", "k_max"):
            if task[name] is None:
                raise ValueError(f"task.{name}: missing; task.kind='running_sums' needs it ({_help('task', name)})")
        return
    if task["source"] is None:
        raise ValueError(f"task.source: missing; task.kind={task['kind']!r} reads its prompts from a file")
    known = [f.name for f in dataclasses.fields(SourceConfig) if f"task.source.{f.name}" not in TAKEN_FROM]
    for key in task["source"].keys():
        if key not in known:
            _refuse_unknown(f"task.source.{key}", key, task["source"][key], known)


def _help(section: str, name: str) -> str:
    return next(f.help for f in schema()[section] if f.name == name)


def _check_rollout(rollout: RolloutSpec) -> None:
    smallest = rollout.min_prefill_bucket
    if smallest and (smallest < max(1, rollout.page_size) or smallest & (smallest - 1)):
        raise ValueError(
            f"rollout.min_prefill_bucket={smallest}; expected 0 (the page size) or a power of two >= "
            f"rollout.page_size={rollout.page_size}"
        )
    rollout.migration_costs()  # a bad policy or rate fails here, naming the field
    if rollout.heartbeat_timeout_s <= 0:
        raise ValueError(f"rollout.heartbeat_timeout_s={rollout.heartbeat_timeout_s}; expected > 0")
    if rollout.max_new_tokens >= rollout.cache_length:
        raise ValueError(
            f"rollout.max_new_tokens={rollout.max_new_tokens} must be < rollout.cache_length={rollout.cache_length}"
        )


def _check_choices(model: ModelSpec, log: LogSpec) -> None:
    for field, value, allowed in (
        ("model.moe_dispatch", model.moe_dispatch, MOE_DISPATCHES),
        ("model.attention", model.attention, ATTENTION_IMPLEMENTATIONS),
        ("model.remat", model.remat, REMAT_POLICIES),
    ):
        if value not in allowed:
            raise ValueError(f"{field}={value!r}; expected one of {allowed}")
    if log.wandb_mode not in ("online", "offline", "disabled"):
        raise ValueError(f"log.wandb_mode={log.wandb_mode!r}; expected 'online', 'offline' or 'disabled'")


def _check_eval(evaluation: EvalSpec) -> None:
    for field, value, low in (("every_steps", evaluation.every_steps, 0), ("samples", evaluation.samples, 0)):
        if value < low:
            raise ValueError(f"eval.{field}={value}; expected >= {low}")
    if evaluation.enabled and evaluation.num_prompts < 1:
        raise ValueError(f"eval.num_prompts={evaluation.num_prompts}; expected >= 1 when eval.every_steps > 0")


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


def describe() -> str:
    """Every config field, section by section: `section.name  type = default  description`."""
    lines = []
    for section, fields in schema().items():
        lines.append(f"[{section or 'top level'}]")
        for f in fields:
            default = "required" if f.default is REQUIRED else f"= {f.default!r}"
            kind = "{axis: size}" if f.type == MeshShape else getattr(f.type, "__name__", str(f.type))
            lines.append(f"  {f.path:<44} {kind:<14} {default:<14} {f.help}")
    lines.append(f"[also read elsewhere, not by parse] {', '.join(f'{k} ({v})' for k, v in OTHER_SECTIONS.items())}")
    return "\n".join(lines)


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


if __name__ == "__main__":
    print(describe())
