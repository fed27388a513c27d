"""The pure train step: advantages, `num_updates` optimizer updates, micro-batch accumulation.

Shape letters: B samples, T positions, U optimizer updates per batch, M micro-batches per update,
C micro-batch rows (B = U * M * C).

`train_step(state, inputs, ref_params, *, ...) -> (state, StepOutputs)` is pure; the `Trainer`
jits it once with explicit shardings and donates the state. Each update's gradient is the sum of
its micro-batch gradients, which equals the full mini-batch gradient because the token weights of
`token_weights` are computed over the whole mini-batch first. An update whose loss or gradient is
not finite is skipped (params and optimizer state kept) and counted.

MoE models: every micro-batch's forward also returns its routing; the step reports the expert
load over the loss-mask tokens (`router_load_LX`, L MoE layers x X experts) and the
load-balancing loss, which enters the objective only with `router_aux_coef` > 0 (off by default:
RL fine-tuning keeps the router as trained).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dora_jax.models.moe import expert_load, load_balancing_loss
from dora_jax.trainer.advantages import group_advantages, informative_samples
from dora_jax.trainer.loss import LossConfig, LossStats, hidden_token_logps, policy_loss, token_weights

SCHEDULES = ("constant", "cosine")


@flax.struct.dataclass
class TrainState:
    params: Any
    opt_state: Any
    updates: jax.Array  # optimizer updates applied so far (skipped ones excluded): the schedule's step


@flax.struct.dataclass
class StepInputs:
    """A TrainBatch on device plus the recomputed behaviour log-probs.

    Token arrays come laid out [U, M, C, T] (row b of the batch at its C-order index), sharded
    over C, so that slicing an update or a micro-batch never moves data; per-sample arrays stay
    flat [B] (group statistics need the whole batch) and replicated.
    """

    tokens_UMCT: jax.Array
    loss_mask_UMCT: jax.Array
    inference_logps_UMCT: jax.Array
    behaviour_logps_UMCT: jax.Array
    rewards_B: jax.Array
    valid_B: jax.Array
    group_ids_B: jax.Array
    # 1 where a row's behaviour policy is the params this step starts from (see `_micro_loss`);
    # None: every behaviour log-prob comes in `behaviour_logps_UMCT`
    behaviour_current_UMC: jax.Array | None = None


@flax.struct.dataclass
class StepOutputs:
    loss: jax.Array  # mean over the U updates
    grad_norm: jax.Array  # mean pre-clip global norm over the U updates
    finite_U: jax.Array  # 1 where the update was applied
    dropped_groups: jax.Array
    updates: jax.Array  # TrainState.updates after the step
    stats: LossStats
    router_load_LX: jax.Array  # MoE: assignments per layer and expert over the step's loss tokens ([0, 0] if dense)
    router_aux_loss: jax.Array  # MoE: load-balancing loss, mean over micro-batches (0 if dense)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-6
    warmup_steps: int = 0  # optimizer updates of linear warm-up from 0
    schedule: str = "constant"  # "constant" or "cosine" after warm-up
    decay_steps: int = 10_000  # optimizer updates from start to the end of the cosine
    final_lr_fraction: float = 0.1
    b1: float = 0.9
    b2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 0.01
    clip_grad_norm: float | None = 1.0


def make_schedule(config: OptimizerConfig) -> optax.Schedule:
    """Learning rate per applied optimizer update: linear warm-up from 0, then constant or cosine."""
    if config.schedule not in SCHEDULES:
        raise ValueError(f"schedule={config.schedule!r}; expected one of {SCHEDULES}")
    if config.schedule == "cosine":
        if config.decay_steps <= config.warmup_steps:
            raise ValueError(f"decay_steps={config.decay_steps} must exceed warmup_steps={config.warmup_steps}")
        return optax.warmup_cosine_decay_schedule(
            0.0, config.lr, config.warmup_steps, config.decay_steps, end_value=config.lr * config.final_lr_fraction
        )
    if config.warmup_steps:
        return optax.join_schedules(
            [optax.linear_schedule(0.0, config.lr, config.warmup_steps), optax.constant_schedule(config.lr)],
            [config.warmup_steps],
        )
    return optax.constant_schedule(config.lr)


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on `make_schedule`. Skipped updates do not advance it."""
    adamw = optax.adamw(
        make_schedule(config), b1=config.b1, b2=config.b2, eps=config.adam_eps, weight_decay=config.weight_decay
    )
    if config.clip_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(config.clip_grad_norm), adamw)


def init_state(params, tx: optax.GradientTransformation) -> TrainState:
    return TrainState(params=params, opt_state=tx.init(params), updates=jnp.zeros((), jnp.int32))


def model_token_logps(model, tokens_BT, vocab_chunk: int, *, return_routing: bool = False, temperature: float = 1.0):
    """(logps_BT, entropy_BT) of a full forward of `model` at `temperature` (softmax of logits /
    temperature), the vocabulary taken `vocab_chunk` entries at a time (`hidden_token_logps`);
    with `return_routing`, also the MoE routing."""
    out = model(tokens_BT, return_hidden=True, return_routing=return_routing)
    x_BTE, routing = out if return_routing else (out, None)
    logps = hidden_token_logps(model.unembed, x_BTE, tokens_BT, model.config.vocab_size, vocab_chunk, temperature)
    return (logps, routing) if return_routing else logps


def sequence_logps(graphdef, params, tokens_BT, vocab_chunk: int = LossConfig.vocab_chunk, temperature: float = 1.0):
    """(logps_BT, entropy_BT) of a full forward of the model `nnx.merge(graphdef, params)` at
    `temperature`."""
    return model_token_logps(nnx.merge(graphdef, params), tokens_BT, vocab_chunk, temperature=temperature)


def _micro_loss(
    params,
    micro,
    weights_CT,
    ref_params,
    *,
    graphdef,
    loss_config: LossConfig,
    router_aux_coef: float = 0.0,
    micro_batches: int | jax.Array = 1,
):
    """Loss and (LossStats, (router_load_LX, router_aux_loss)) of one micro-batch (a dict of
    [C, ...] arrays) under `params`; the aux loss enters with weight router_aux_coef / micro_batches
    (a Python int, or a traced count where the number of micro-batches varies per update)."""
    model = nnx.merge(graphdef, params)
    (logps_CT, entropy_CT), routing = model_token_logps(
        model, micro["tokens"], loss_config.vocab_chunk, return_routing=True, temperature=loss_config.temperature
    )
    behaviour_CT = micro["behaviour"]
    if "current" in micro:
        # Rows generated by the very params of this forward (the trainer's current version, first
        # update): their behaviour log-probs are this forward's own, held constant; no recompute.
        behaviour_CT = jnp.where(micro["current"][:, None] > 0, jax.lax.stop_gradient(logps_CT), behaviour_CT)
    ref_CT = None
    if ref_params is not None:
        ref_logps_CT = sequence_logps(
            graphdef, ref_params, micro["tokens"], loss_config.vocab_chunk, loss_config.temperature
        )[0]
        ref_CT = jax.lax.stop_gradient(ref_logps_CT)
    loss, stats = policy_loss(
        logps_CT,
        behaviour_CT,
        micro["inference"],
        micro["adv"],
        micro["mask"],
        weights_CT,
        loss_config,
        ref_logps_BT=ref_CT,
        entropy_BT=entropy_CT,
    )
    load_LX = jnp.stack([expert_load(r, micro["mask"]) for r in routing]) if routing else jnp.zeros((0, 0))
    aux = load_balancing_loss(routing, micro["mask"])
    if router_aux_coef:
        loss = loss + (router_aux_coef / micro_batches) * aux
    return loss, (stats, (load_LX, aux))


def _one_update(
    state: TrainState, mini, ref_params, *, graphdef, tx, loss_config: LossConfig, router_aux_coef: float = 0.0
):
    """One optimizer update from a mini-batch of [M, C, ...] arrays, skipped if not finite."""
    M, C, T = mini["mask"].shape
    weights_MCT = token_weights(mini["mask"].reshape(M * C, T), loss_config.loss_norm, loss_config.t_max)
    micro_loss_fn = functools.partial(
        _micro_loss, graphdef=graphdef, loss_config=loss_config, router_aux_coef=router_aux_coef, micro_batches=M
    )
    grad_fn = jax.value_and_grad(micro_loss_fn, has_aux=True)

    def accumulate(carry, xs):
        grads, loss, stats = carry
        micro, weights_CT = xs
        (micro_loss, (micro_stats, router)), micro_grads = grad_fn(state.params, micro, weights_CT, ref_params)
        return (jax.tree.map(jnp.add, grads, micro_grads), loss + micro_loss, stats.merge(micro_stats)), router

    carry = (jax.tree.map(jnp.zeros_like, state.params), jnp.zeros((), jnp.float32), LossStats.empty())
    (grads, loss, stats), (load_MLX, aux_M) = jax.lax.scan(accumulate, carry, (mini, weights_MCT.reshape(M, C, T)))
    new_state, grad_norm, finite = apply_grads(state, grads, loss, tx=tx)
    return new_state, (loss, grad_norm, finite, stats, (load_MLX.sum(0), aux_M.mean()))


def apply_grads(state: TrainState, grads, loss, *, tx):
    """One optimizer update from summed micro-batch gradients; skipped (state kept) if not finite."""
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    deltas, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, deltas)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
    new_state = TrainState(
        params=keep(params, state.params),
        opt_state=keep(opt_state, state.opt_state),
        updates=state.updates + finite.astype(jnp.int32),
    )
    return new_state, grad_norm, finite


def batch_advantages(rewards_B, group_ids_B, valid_B, *, estimator: str, dynamic_sampling: bool):
    """(advantages_B, valid_B after DAPO's dynamic sampling, dropped groups): the per-sample part
    of `train_step`, for callers that run the micro-batches themselves."""
    valid_B = valid_B.astype(jnp.float32)
    dropped = jnp.zeros((), jnp.int32)
    if dynamic_sampling:
        keep_B, dropped = informative_samples(rewards_B, group_ids_B, valid_B)
        valid_B = valid_B * keep_B
    return group_advantages(rewards_B, group_ids_B, valid_B, estimator), valid_B, dropped.astype(jnp.int32)


def train_step(
    state: TrainState,
    inputs: StepInputs,
    ref_params,
    *,
    graphdef,
    tx: optax.GradientTransformation,
    loss_config: LossConfig,
    estimator: str,
    dynamic_sampling: bool,
    rows_sharding=None,
    router_aux_coef: float = 0.0,
) -> tuple[TrainState, StepOutputs]:
    """U optimizer updates, one per leading slice of the [U, M, C, T] inputs; see the module docstring.

    `ref_params` (or None) is the KL reference policy; `router_aux_coef` weights the MoE
    load-balancing loss (0: reported, not optimised). `rows_sharding` (optional) is the sharding
    of a [U, M, C] array, so that advantages and validity are laid out like the token arrays.
    """
    U, M, C, _ = inputs.tokens_UMCT.shape
    adv_B, valid_B, dropped = batch_advantages(
        inputs.rewards_B, inputs.group_ids_B, inputs.valid_B, estimator=estimator, dynamic_sampling=dynamic_sampling
    )
    adv_UMC = adv_B.reshape(U, M, C)
    valid_UMC = valid_B.reshape(U, M, C)
    if rows_sharding is not None:
        adv_UMC = jax.lax.with_sharding_constraint(adv_UMC, rows_sharding)
        valid_UMC = jax.lax.with_sharding_constraint(valid_UMC, rows_sharding)
    rows = dict(
        tokens=inputs.tokens_UMCT,
        mask=inputs.loss_mask_UMCT.astype(jnp.float32) * valid_UMC[..., None],
        inference=inputs.inference_logps_UMCT,
        behaviour=inputs.behaviour_logps_UMCT,
        adv=adv_UMC,
    )
    if inputs.behaviour_current_UMC is not None:
        rows["current"] = inputs.behaviour_current_UMC
    update = functools.partial(
        _one_update,
        ref_params=ref_params,
        graphdef=graphdef,
        tx=tx,
        loss_config=loss_config,
        router_aux_coef=router_aux_coef,
    )
    state, (loss_U, grad_norm_U, finite_U, stats_U, (load_ULX, aux_U)) = jax.lax.scan(update, state, rows)
    stats = jax.tree.map(lambda x: x[0], stats_U)
    for u in range(1, U):
        stats = stats.merge(jax.tree.map(lambda x, u=u: x[u], stats_U))
    outputs = StepOutputs(
        loss=loss_U.mean(),
        grad_norm=grad_norm_U.mean(),
        finite_U=finite_U.astype(jnp.int32),
        dropped_groups=dropped.astype(jnp.int32),
        updates=state.updates,
        stats=stats,
        router_load_LX=load_ULX.sum(0),
        router_aux_loss=aux_U.mean(),
    )
    return state, outputs
