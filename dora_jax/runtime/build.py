"""What every run builds before its roles start: tokenizer, task, model and its starting params.

A fresh tiny model (no `model.hf_path`) on the running-sums task gets a supervised cold start
(`dora_jax.sft`) cached in WORKDIR/sft, unless `init.checkpoint` names a HF checkpoint to start from.
"""

from __future__ import annotations

import dataclasses

from jax.sharding import Mesh

from dora_jax import models
from dora_jax.models.tokenizer import CharTokenizer, HFTokenizer
from dora_jax.parallel.sharding import TRAINER_RULES
from dora_jax.runtime.cold_start import cold_start
from dora_jax.runtime.run_config import RunConfig, task_config
from dora_jax.tasks import running_sums
from dora_jax.tasks.task import Task, make_task


@dataclasses.dataclass
class Setup:
    model_config: models.ModelConfig
    graphdef: object
    params: dict
    axes: dict
    tokenizer: object
    task: Task
    eos_ids: tuple[int, ...]
    reward_workers: int
    reward_timeout_s: float


def make_tokenizer(config: RunConfig):
    if config.task.kind == "running_sums" and not config.model.hf_path:
        return CharTokenizer(running_sums.ALPHABET)
    path = config.model.hf_path or config.init.checkpoint
    if not path:
        raise ValueError(f"task.kind={config.task.kind!r} needs model.hf_path (a HF checkpoint with tokenizer.json)")
    return HFTokenizer(path)


def fresh_model_config(config: RunConfig, vocab_size: int, eos_ids) -> models.ModelConfig:
    """A Qwen3 (dense), or a Qwen3-MoE with every layer sparse when model.num_experts > 0."""
    m = config.model
    moe = models.moe_fields(m) or dict(model_type="qwen3")
    return models.ModelConfig(
        **moe,
        qk_norm=True,
        vocab_size=vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        tie_word_embeddings=True,
        max_position_embeddings=config.rollout.cache_length,
        dtype=models.dtype_from_name(m.dtype),
        param_dtype=models.dtype_from_name(m.param_dtype),
        eos_token_id=tuple(eos_ids),
        bos_token_id=CharTokenizer.BOS,
        attention=m.attention,
        remat=m.remat,
        scan_layers=m.scan_layers,
    )


def vocab_size(config: RunConfig, tokenizer) -> int:
    """The model's vocabulary (every token id rollout can sample is below it) without building
    the model: the HF checkpoint's config.json, or the tokenizer's (`fresh_model_config`)."""
    start = config.init.checkpoint or config.model.hf_path
    return models.read_config(start).vocab_size if start else tokenizer.vocab_size


def build_setup(config: RunConfig, workdir: str, mesh: Mesh | None = None) -> Setup:
    """With `mesh` (the trainer's), a HF checkpoint is read straight into the trainer's shardings:
    each device receives only its own shards, never a whole tensor (a 7B model in fp32 is 30 GB)."""
    tokenizer = make_tokenizer(config)
    task = make_task(task_config(config), tokenizer)
    dtype = models.dtype_from_name(config.model.dtype)
    param_dtype = models.dtype_from_name(config.model.param_dtype)
    start = config.init.checkpoint or config.model.hf_path
    if start:
        model = models.load_hf(
            start,
            dtype=dtype,
            param_dtype=param_dtype,
            mesh=mesh,
            rules=TRAINER_RULES,
            moe_dispatch=config.model.moe_dispatch,
            attention=config.model.attention,
            remat=config.model.remat,
            scan_layers=config.model.scan_layers,
        )
    else:
        model_config = fresh_model_config(config, tokenizer.vocab_size, tokenizer.eos_ids)
        model = cold_start(config, model_config, tokenizer, workdir, mesh=mesh)
    graphdef, params = models.split(model)
    eos = tuple(model.config.eos_ids) or tuple(tokenizer.eos_ids)
    return Setup(
        model.config,
        graphdef,
        params,
        models.logical_axes(model),
        tokenizer,
        task,
        eos,
        int(config.task.reward_workers),
        float(config.task.reward_timeout_s),
    )
