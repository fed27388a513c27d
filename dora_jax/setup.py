"""What every run builds before its roles start: tokenizer, task, model and its starting params.

A fresh tiny model (no `model.hf_path`) on the running-sums task gets a supervised cold start
(`dora_jax.sft`) cached in WORKDIR/sft, unless `init.checkpoint` names a HF checkpoint to start from.
"""

from __future__ import annotations

import dataclasses
import os

from dora_jax import models
from dora_jax.models.tokenizer import CharTokenizer, HFTokenizer
from dora_jax.run_config import RunConfig
from dora_jax.tasks import running_sums
from dora_jax.tasks.sources import SourceConfig
from dora_jax.tasks.task import Task, TaskConfig, make_task


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


def task_config(config: RunConfig) -> TaskConfig:
    t = config.task
    if t.kind == "running_sums":
        rs = running_sums.RunningSumsConfig(median_k=t.median_k, sigma=t.sigma, k_max=t.k_max,
                                            max_term=int(t.get("max_term", 2)), seed=config.seed)
        return TaskConfig(kind="running_sums", running_sums=rs)
    source = SourceConfig(**{k: v for k, v in t.source.items()}, seed=config.seed)
    return TaskConfig(kind=t.kind, source=source)


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
        **moe, qk_norm=True, vocab_size=vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
        tie_word_embeddings=True, max_position_embeddings=config.rollout.cache_length,
        dtype=models.dtype_from_name(m.dtype), param_dtype=models.dtype_from_name(m.param_dtype),
        eos_token_id=tuple(eos_ids), bos_token_id=CharTokenizer.BOS,
    )


def build_setup(config: RunConfig, workdir: str) -> Setup:
    tokenizer = make_tokenizer(config)
    task = make_task(task_config(config), tokenizer)
    dtype = models.dtype_from_name(config.model.dtype)
    param_dtype = models.dtype_from_name(config.model.param_dtype)
    start = config.init.checkpoint or config.model.hf_path
    if start:
        model = models.load_hf(start, dtype=dtype, param_dtype=param_dtype, moe_dispatch=config.model.moe_dispatch)
    else:
        model_config = fresh_model_config(config, tokenizer.vocab_size, tokenizer.eos_ids)
        model = cold_start(config, model_config, tokenizer, workdir)
    graphdef, params = models.split(model)
    eos = tuple(model.config.eos_ids) or tuple(tokenizer.eos_ids)
    return Setup(model.config, graphdef, params, models.logical_axes(model), tokenizer, task, eos,
                 int(config.task.reward_workers), float(config.task.reward_timeout_s))


def cold_start(config: RunConfig, model_config: models.ModelConfig, tokenizer, workdir: str) -> models.Decoder:
    """A fresh model, briefly trained on correct demonstrations; cached as a HF checkpoint."""
    path = os.path.join(workdir, "sft")
    if os.path.exists(os.path.join(path, "DONE")):
        return models.load_hf(path, dtype=model_config.dtype, param_dtype=model_config.param_dtype,
                              moe_dispatch=model_config.moe_dispatch)
    model = models.init_model(model_config, seed=config.seed)
    if config.init.sft_steps <= 0 or config.task.kind != "running_sums":
        return model
    from dora_jax.cold_start import sft_running_sums

    model = sft_running_sums(model, tokenizer, config, log_path=os.path.join(workdir, "sft_log.jsonl"))
    models.save_hf(model, path)
    with open(os.path.join(path, "DONE"), "w") as f:
        f.write("ok\n")
    return model
