"""Supervised cold start: plain next-token loss on correct demonstrations, same model code,
sharded the same way as the RL trainer (TRAINER_RULES on the trainer slice). The CLI is
`python -m dora_jax.sft`. Shape letters: B batch, T time, V vocab.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dora_jax import models
from dora_jax.core import fs
from dora_jax.parallel import sharding
from dora_jax.runtime.run_config import RunConfig, task_config
from dora_jax.tasks import running_sums
from dora_jax.trainer.batching import bucket_length


def _loss(graphdef, params, tokens_BT, mask_BT):
    """Mean negative log-likelihood of the tokens where mask_BT = 1 (each predicted from its prefix)."""
    logits_BTV = nnx.merge(graphdef, params)(tokens_BT[:, :-1])
    logps_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
    target_logps_BT = jnp.take_along_axis(logps_BTV, tokens_BT[:, 1:, None], axis=-1)[..., 0]
    mask_BT = mask_BT[:, 1:]
    return -(target_logps_BT * mask_BT).sum() / jnp.maximum(mask_BT.sum(), 1.0)


def demonstration_batch(source, tokenizer, batch_size: int, pad_to: int) -> tuple[np.ndarray, np.ndarray]:
    """[B, T + 1] tokens (prompt, demonstration, EOS, padding) and the response mask; T is a
    `pad_to * 2^k` bucket (as the RL trainer's batches), so a run compiles a handful of steps."""
    rows = []
    for _ in range(batch_size):
        prompt = source.next()
        response = tokenizer.encode(running_sums.demonstration(prompt)) + list(tokenizer.eos_ids[:1])
        rows.append((list(prompt.prompt_ids), response))
    T = bucket_length(max(len(p) + len(r) for p, r in rows), pad_to) + 1
    tokens = np.full((batch_size, T), tokenizer.pad_id, np.int32)
    mask = np.zeros((batch_size, T), np.float32)
    for b, (p, r) in enumerate(rows):
        tokens[b, : len(p) + len(r)] = p + r
        mask[b, len(p) : len(p) + len(r)] = 1.0
    return tokens, mask


def demonstration_source(config: RunConfig, tokenizer) -> running_sums.RunningSumsSource:
    """The RL run's task distribution (`task.*`), drawn with another seed: other prompts."""
    task = dataclasses.replace(task_config(config).running_sums, seed=config.seed + 10_000)
    return running_sums.RunningSumsSource(task, tokenizer)


def sft_running_sums(
    model: models.Decoder, tokenizer, config: RunConfig, *, log_path: str | None = None
) -> models.Decoder:
    """Trains `model` for `config.init.sft_steps` updates on running-sums demonstrations."""
    slices = sharding.split_devices(
        dict(config.mesh.trainer),
        dict(config.mesh.rollout),
        config.rollout.num_slices,
        time_shared=config.mesh.time_shared,
    )
    mesh = slices.trainer
    graphdef, params = models.split(model)
    param_shardings = sharding.tree_shardings(models.logical_axes(model), params, mesh, sharding.TRAINER_RULES)
    params = jax.device_put(params, param_shardings)
    steps = config.init.sft_steps
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.init.sft_lr, max(steps // 10, 1), steps, config.init.sft_lr * 0.1
    )
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.0))
    opt_state = jax.jit(tx.init)(params)
    batch_sharding = sharding.logical_sharding(
        ("batch", None), (config.init.sft_batch_size, 1), mesh, sharding.TRAINER_RULES
    )

    @jax.jit
    def step(params, opt_state, tokens_BT, mask_BT):
        loss, grads = jax.value_and_grad(lambda p: _loss(graphdef, p, tokens_BT, mask_BT))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    source = demonstration_source(config, tokenizer)
    log = fs.open(log_path, "a") if log_path else None
    start = time.perf_counter()
    for i in range(steps):
        tokens, mask = demonstration_batch(source, tokenizer, config.init.sft_batch_size, config.pad_to)
        tokens, mask = jax.device_put((tokens, mask), batch_sharding)
        params, opt_state, loss = step(params, opt_state, tokens, mask)
        if log and (i % 25 == 0 or i == steps - 1):
            log.write(json.dumps({"sft_step": i, "loss": float(loss), "wall_s": time.perf_counter() - start}) + "\n")
            log.flush()
    if log:
        log.close()
    return nnx.merge(graphdef, jax.device_get(params))


def cold_start(
    config: RunConfig, model_config: models.ModelConfig, tokenizer, workdir: str, *, mesh=None
) -> models.Decoder:
    """A fresh model, briefly trained on correct demonstrations; cached as a HF checkpoint (read
    back into `mesh`'s trainer shardings when given). On a gs:// workdir the checkpoint is copied
    through dora_jax.core.fs (HF safetensors I/O is local), DONE last."""
    path = fs.join(workdir, "sft")
    if fs.exists(fs.join(path, "DONE")):
        if not fs.is_remote(path):
            return _load_sft(path, model_config, mesh)
        with tempfile.TemporaryDirectory(prefix="dora_sft_") as local:
            fs.copy_dir(path, local)
            return _load_sft(local, model_config, mesh)
    model = models.init_model(model_config, seed=config.seed)
    if config.init.sft_steps <= 0 or config.task.kind != "running_sums":
        return model
    model = sft_running_sums(model, tokenizer, config, log_path=fs.join(workdir, "sft_log.jsonl"))
    if fs.is_remote(path):
        with tempfile.TemporaryDirectory(prefix="dora_sft_") as local:
            models.save_hf(model, local)
            fs.copy_dir(local, path)
    else:
        models.save_hf(model, path)
    with fs.open(fs.join(path, "DONE"), "w") as f:
        f.write("ok\n")
    return model


def _load_sft(path: str, model_config: models.ModelConfig, mesh) -> models.Decoder:
    return models.load_hf(
        path,
        dtype=model_config.dtype,
        param_dtype=model_config.param_dtype,
        mesh=mesh,
        rules=sharding.TRAINER_RULES,
        moe_dispatch=model_config.moe_dispatch,
        attention=model_config.attention,
        remat=model_config.remat,
        scan_layers=model_config.scan_layers,
    )
