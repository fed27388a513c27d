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
    the contiguous groups, unsorted and weighted: only the useful flops. Its weight gradient is
    a ragged dot whose ragged dimension is contracted, which the TPU compiler (libtpu 0.0.42)
    expands into a dense masked computation over every group: compiled for a v5p chip, one
    [8192, 2048] x [128, 2048, 768] projection's gradient counts 3.33 PFLOP against 51.5 GFLOP
    useful, and the 30B-A3B trainer's 32K-token micro-batch 3,941 TFLOP per chip.
  * "megablox": "grouped" with the weight gradient through the megablox `tgmm` Pallas kernel
    (`jax.experimental.pallas.ops.tpu.megablox`), each device computing its own experts' slice
    (`expert` x `embed` x `mlp` from the logical rules in context, under `shard_map`, as the
    attention kernel does); the forward and the input gradient stay ragged dots, which the TPU
    compiles natively. For TPU training. "megablox_interpret": the same kernel run by the
    Pallas interpreter on any backend (tests).
There is no expert capacity: no token is ever dropped, so there is no dropped-token count.

Router statistics (`Routing`) come out of the forward on request (`Decoder(..., return_routing=
True)`); `expert_load` and `load_balancing_loss` reduce them over the tokens of a mask.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import spmd
from jax.sharding import PartitionSpec

from dora_jax.models.params import normal, param

DISPATCHES = ("dense", "grouped", "megablox", "megablox_interpret")


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


def _ragged_dot(x_AE, w_XEF, sizes_X, names):
    del names
    return jax.lax.ragged_dot(x_AE, w_XEF, sizes_X)


_IN, _OUT = ("expert", "embed", "mlp"), ("expert", "mlp", "embed")  # logical names of gate/up, of down


def grouped_experts(x_NE, weights_NK, experts_NK, gate_XEM, up_XEM, down_XME, *, matmul=_ragged_dot):
    """Assignments sorted by expert, one ragged matmul per projection, unsorted and weighted.
    `matmul(x, w, sizes, logical names of w)`: the ragged matmul."""
    N, K = experts_NK.shape
    X = gate_XEM.shape[0]
    experts_A = experts_NK.reshape(-1)
    order_A = jnp.argsort(experts_A, stable=True)  # assignment index of each sorted row
    x_AE = jnp.take(x_NE, order_A // K, axis=0)  # assignment a belongs to token a // K
    sizes_X = jnp.bincount(experts_A, length=X).astype(jnp.int32)
    h_AM = jax.nn.silu(matmul(x_AE, gate_XEM, sizes_X, _IN)) * matmul(x_AE, up_XEM, sizes_X, _IN)
    y_AE = matmul(h_AM, down_XME, sizes_X, _OUT)
    y_NKE = jnp.zeros_like(y_AE).at[order_A].set(y_AE).reshape(N, K, -1)  # back to assignment order
    return jnp.einsum("nk,nke->ne", weights_NK.astype(y_NKE.dtype), y_NKE)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _ragged_matmul(x_AE, w_XEF, sizes_X, names, interpret: bool):
    """`jax.lax.ragged_dot` whose weight gradient is the megablox `tgmm` kernel."""
    return jax.lax.ragged_dot(x_AE, w_XEF, sizes_X)


def _ragged_matmul_fwd(x_AE, w_XEF, sizes_X, names, interpret):
    return jax.lax.ragged_dot(x_AE, w_XEF, sizes_X), (x_AE, w_XEF, sizes_X)


def _ragged_matmul_bwd(names, interpret, residuals, g_AF):
    x_AE, w_XEF, sizes_X = residuals
    dx_AE = jax.lax.ragged_dot(g_AF, jnp.swapaxes(w_XEF, 1, 2), sizes_X)  # ragged rows: compiled natively
    dw_XEF = _weight_gradient(x_AE, g_AF, sizes_X, w_XEF.shape[0], names, interpret)
    return dx_AE.astype(x_AE.dtype), dw_XEF.astype(w_XEF.dtype), None


_ragged_matmul.defvjp(_ragged_matmul_fwd, _ragged_matmul_bwd)


def _weight_gradient(x_AE, g_AF, sizes_X, X: int, names, interpret: bool):
    """dW[x] = x_A[group x]^T g_A[group x] for every group x, by the megablox `tgmm` kernel. On a
    mesh (from `jax.set_mesh`) each device computes its own block of dW (`names`: the weight's
    logical axes): its experts (`group_offset` on the expert axis), its slices of the input and
    output features."""
    from jax.experimental.pallas.ops.tpu.megablox.gmm import tgmm  # the module (the package's `gmm` is a function)

    def kernel(x_AE, g_AF, sizes_X, experts: int, first):
        tiling = (128, min(128, x_AE.shape[1]), min(128, g_AF.shape[1]))
        return tgmm(
            x_AE.swapaxes(0, 1),
            g_AF,
            sizes_X,
            jnp.float32,
            tiling,
            group_offset=first,
            num_actual_groups=experts,
            interpret=interpret,
        )

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return kernel(x_AE, g_AF, sizes_X, X, None)
    rules = dict(spmd.get_logical_axis_rules())
    if not rules:
        raise ValueError(
            "moe_dispatch='megablox' on a mesh of several devices needs the logical axis rules in context "
            "(`with nnx.logical_axis_rules(rules):`) to place its operands"
        )
    expert_axis, in_axis, out_axis = (rules.get(name) for name in names)
    shards = mesh.shape[expert_axis] if expert_axis else 1

    def local(x_AE, g_AF, sizes_X):
        first = jax.lax.axis_index(expert_axis) * (X // shards) if expert_axis else 0
        return kernel(x_AE, g_AF, sizes_X, X // shards, jnp.asarray(first, jnp.int32))

    sharded = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(PartitionSpec(None, in_axis), PartitionSpec(None, out_axis), PartitionSpec()),
        out_specs=PartitionSpec(expert_axis, in_axis, out_axis),
        check_vma=False,
    )
    return sharded(x_AE, g_AF, sizes_X)


def _megablox_experts(*args, interpret: bool):
    def matmul(x_AE, w_XEF, sizes_X, names):
        return _ragged_matmul(x_AE, w_XEF, sizes_X, names, interpret)

    return grouped_experts(*args, matmul=matmul)


_COMPUTE = {
    "dense": dense_experts,
    "grouped": grouped_experts,
    "megablox": functools.partial(_megablox_experts, interpret=False),
    "megablox_interpret": functools.partial(_megablox_experts, interpret=True),
}


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
