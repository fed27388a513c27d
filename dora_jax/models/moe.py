"""Sparse mixture-of-experts feed-forward (Qwen3-MoE): top-k softmax routing over stacked experts.

Shape letters: B batch, T time, N = B * T tokens, E embed, X experts, K experts per token,
M expert mlp width, A = N * K token-expert assignments, L MoE layers.

Routing, as HF Qwen3-MoE: probs_NX = softmax(x_NE @ router_EX) in float32; each token's K most
probable experts are its experts, weighted by their probabilities (renormalised to sum to 1 when
`norm_topk_prob`). The output is sum_k w_k * expert_k(x) with expert(x) = down(silu(gate(x)) * up(x)).

Two computations give the same numbers (`ModelConfig.moe_dispatch`):
  * "dense": every expert on every token, weighted by the sparse gates (0 for experts not
    chosen). X / K times the useful flops, but plain einsums: the fallback for tiny models on CPU.
    With the experts sharded over the `expert` mesh axis each device computes its own experts
    and one reduction over that axis combines them.
  * "grouped": the A assignments sorted by expert, one `jax.lax.ragged_dot` per projection over
    the contiguous groups, unsorted and weighted: only the useful flops.
There is no expert capacity: no token is ever dropped, so there is no dropped-token count.

Router statistics (`Routing`) come out of the forward on request (`Decoder(..., return_routing=
True)`); `expert_load` and `load_balancing_loss` reduce them over the tokens of a mask.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from dora_jax.models.params import normal, param

DISPATCHES = ("dense", "grouped")


@flax.struct.dataclass
class Routing:
    """One MoE layer's routing of B x T tokens."""

    probs_BTX: jax.Array  # float32 router softmax over all experts
    experts_BTK: jax.Array  # int32 chosen experts, most probable first


def route(logits_NX, k: int, norm_topk_prob: bool):
    """(probs_NX float32, weights_NK float32, experts_NK int32) of top-k softmax routing."""
    probs_NX = jax.nn.softmax(logits_NX.astype(jnp.float32), axis=-1)
    weights_NK, experts_NK = jax.lax.top_k(probs_NX, k)
    if norm_topk_prob:
        weights_NK = weights_NK / jnp.sum(weights_NK, axis=-1, keepdims=True)
    return probs_NX, weights_NK, experts_NK.astype(jnp.int32)


def dense_experts(x_NE, weights_NK, experts_NK, gate_XEM, up_XEM, down_XME):
    """Every expert on every token; the gates (zero off the chosen experts) weight the sum."""
    X = gate_XEM.shape[0]
    gates_NX = jnp.einsum("nk,nkx->nx", weights_NK, jax.nn.one_hot(experts_NK, X, dtype=weights_NK.dtype))
    h_NXM = jax.nn.silu(jnp.einsum("ne,xem->nxm", x_NE, gate_XEM)) * jnp.einsum("ne,xem->nxm", x_NE, up_XEM)
    y_NXE = jnp.einsum("nxm,xme->nxe", h_NXM, down_XME)
    return jnp.einsum("nx,nxe->ne", gates_NX.astype(y_NXE.dtype), y_NXE)


def grouped_experts(x_NE, weights_NK, experts_NK, gate_XEM, up_XEM, down_XME):
    """Assignments sorted by expert, one ragged matmul per projection, unsorted and weighted."""
    N, K = experts_NK.shape
    X = gate_XEM.shape[0]
    experts_A = experts_NK.reshape(-1)
    order_A = jnp.argsort(experts_A, stable=True)  # assignment index of each sorted row
    x_AE = jnp.take(x_NE, order_A // K, axis=0)  # assignment a belongs to token a // K
    sizes_X = jnp.bincount(experts_A, length=X).astype(jnp.int32)
    h_AM = jax.nn.silu(jax.lax.ragged_dot(x_AE, gate_XEM, sizes_X)) * jax.lax.ragged_dot(x_AE, up_XEM, sizes_X)
    y_AE = jax.lax.ragged_dot(h_AM, down_XME, sizes_X)
    y_NKE = jnp.zeros_like(y_AE).at[order_A].set(y_AE).reshape(N, K, -1)  # back to assignment order
    return jnp.einsum("nk,nke->ne", weights_NK.astype(y_NKE.dtype), y_NKE)


_COMPUTE = {"dense": dense_experts, "grouped": grouped_experts}


class MoE(nnx.Module):
    """Router + X stacked SwiGLU experts; returns (y_BTE, Routing)."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        E, X, M, pd = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.param_dtype
        self.dtype, self.k, self.norm_topk_prob = cfg.dtype, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.compute = _COMPUTE[cfg.moe_dispatch]
        # The router is small and every device needs all of it: only `embed` is named.
        self.router_EX = param(normal(rngs, (E, X), pd), ("embed", None))
        self.gate_XEM = param(normal(rngs, (X, E, M), pd), ("expert", "embed", "mlp"))
        self.up_XEM = param(normal(rngs, (X, E, M), pd), ("expert", "embed", "mlp"))
        self.down_XME = param(normal(rngs, (X, M, E), pd), ("expert", "mlp", "embed"))

    def __call__(self, x_BTE):
        B, T, E = x_BTE.shape
        dt = self.dtype
        x_NE = x_BTE.reshape(B * T, E)
        logits_NX = jnp.einsum("ne,ex->nx", x_NE, self.router_EX[...].astype(dt), preferred_element_type=jnp.float32)
        probs_NX, weights_NK, experts_NK = route(logits_NX, self.k, self.norm_topk_prob)
        y_NE = self.compute(
            x_NE,
            weights_NK.astype(dt),
            experts_NK,
            self.gate_XEM[...].astype(dt),
            self.up_XEM[...].astype(dt),
            self.down_XME[...].astype(dt),
        )
        routing = Routing(probs_BTX=probs_NX.reshape(B, T, -1), experts_BTK=experts_NK.reshape(B, T, -1))
        return y_NE.reshape(B, T, E), routing


def expert_load(routing: Routing, mask_BT) -> jax.Array:
    """float32[X]: assignments each expert received from the tokens where `mask_BT` is 1
    (each token counts once per chosen expert, so the loads sum to K x tokens)."""
    X = routing.probs_BTX.shape[-1]
    hits_BTX = jax.nn.one_hot(routing.experts_BTK, X, dtype=jnp.float32).sum(-2)
    return jnp.einsum("bt,btx->x", mask_BT.astype(jnp.float32), hits_BTX)


def load_balancing_loss(routings: tuple[Routing, ...], mask_BT) -> jax.Array:
    """Switch Transformer auxiliary loss, averaged over the MoE layers:

        aux = mean_layers X * sum_x f_x * P_x,

    f_x = assignments to expert x per masked token (sums to K), P_x = mean router probability of
    x over the masked tokens. Uniform routing gives K. On one layer this is HF's
    `load_balancing_loss_func` (which pools all layers' tokens before the product instead).
    """
    mask_BT = mask_BT.astype(jnp.float32)
    tokens = jnp.maximum(mask_BT.sum(), 1.0)
    per_layer = []
    for routing in routings:
        X = routing.probs_BTX.shape[-1]
        f_X = expert_load(routing, mask_BT) / tokens
        p_X = jnp.einsum("bt,btx->x", mask_BT, routing.probs_BTX) / tokens
        per_layer.append(X * jnp.sum(f_X * p_X))  # f_X carries no gradient (top-k)
    return jnp.mean(jnp.stack(per_layer)) if per_layer else jnp.zeros((), jnp.float32)
