"""Sparse mixture-of-experts feed-forward (Qwen3-MoE): top-k softmax routing over stacked experts.

Shape letters: B batch, T time, N = B * T tokens, E embed, X experts, K experts per token,
M expert mlp width, A = N * K token-expert assignments, L MoE layers.

Routing, as HF Qwen3-MoE: probs_NX = softmax(x_NE @ router_EX) in float32; each token's K most
probable experts are its experts, weighted by their probabilities (renormalised to sum to 1 when
`norm_topk_prob`). The output is sum_k w_k * expert_k(x) with expert(x) = down(silu(gate(x)) * up(x)).

Three computations give the same numbers (`ModelConfig.moe_dispatch`):
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
  * "megablox": every expert projection (forward, input and weight gradients) in the megablox
    Pallas kernels (`jax.experimental.pallas.ops.tpu.megablox`: `gmm`, `tgmm`), with expert
    parallelism on a mesh (`megablox_experts`): the tokens are split over all devices; the
    devices sharing a batch shard all-gather its tokens, each routes and sorts only those and
    computes its own experts (`expert` axis) and expert-width slice (`mlp` axis), and the partial
    outputs are reduce-scattered back. For TPU. "megablox_interpret": the same kernels run by the
    Pallas interpreter on any backend (tests).
There is no expert capacity: no token is ever dropped, so there is no dropped-token count.

Router statistics (`Routing`) come out of the forward on request (`Decoder(..., return_routing=
True)`); `expert_load` and `load_balancing_loss` reduce them over the tokens of a mask.
"""

from __future__ import annotations

import functools
import importlib
import math

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import spmd
from jax.sharding import PartitionSpec

from dora_jax.models.params import normal, param
from dora_jax.parallel.sharding import logical_to_spec

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


def grouped_experts(x_NE, weights_NK, experts_NK, gate_XEM, up_XEM, down_XME):
    """Assignments sorted by expert, one `jax.lax.ragged_dot` per projection, unsorted and weighted."""
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


ROW_TILE, FEATURE_TILE = 512, 1024  # the megablox tiles: assignment rows, and input / output features


def _tile(d: int) -> int:
    """The feature tile for a dimension of d: all of it up to FEATURE_TILE, else the widest of
    1024 / 512 / 256 / 128 that divides it (128: a TPU lane row; the kernel masks a ragged end).
    Each row tile re-reads its expert's weight block, so wide tiles read the weights fewer times:
    one 30B layer's expert projections (forward and backward, compiled for a v5p chip) count
    86.2 GB of accesses with 128-wide tiles, 43.8 GB with these (XLA's cost analysis)."""
    if d <= FEATURE_TILE:
        return d
    return next((t for t in (1024, 512, 256) if d % t == 0), 128)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _gmm(x_AE, w_xEF, sizes_X, first, rows: int, interpret: bool):
    """Rows of the experts [first, first + x) times their weights, in the megablox `gmm` kernel;
    every other row of the output is zero. x_AE's rows are padded to whole row tiles (ROW_TILE, or
    all of them when fewer); the first `rows` are real."""
    return _gmm_fwd(x_AE, w_xEF, sizes_X, first, rows, interpret)[0]


def _megablox():
    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")  # the package's `gmm` is a function


def _zero_padding(y_AF, rows: int):
    """The kernel leaves rows past every group unwritten: zero them (they hold the row padding)."""
    if rows == y_AF.shape[0]:
        return y_AF
    return jnp.where(jnp.arange(y_AF.shape[0])[:, None] < rows, y_AF, jnp.zeros((), y_AF.dtype))


def _gmm_fwd(x_AE, w_xEF, sizes_X, first, rows, interpret):
    tiling = (min(ROW_TILE, x_AE.shape[0]), _tile(x_AE.shape[1]), _tile(w_xEF.shape[2]))
    y_AF = _megablox().gmm(x_AE, w_xEF, sizes_X, x_AE.dtype, tiling, first, interpret=interpret)
    return _zero_padding(y_AF, rows), (x_AE, w_xEF, sizes_X, first)


def _gmm_bwd(rows, interpret, residuals, g_AF):
    x_AE, w_xEF, sizes_X, first = residuals
    kernels = _megablox()
    g_AF = g_AF.astype(x_AE.dtype)
    tiling = (min(ROW_TILE, g_AF.shape[0]), _tile(g_AF.shape[1]), _tile(w_xEF.shape[1]))
    dx_AE = kernels.gmm(g_AF, w_xEF, sizes_X, x_AE.dtype, tiling, first, transpose_rhs=True, interpret=interpret)
    tiling = (min(ROW_TILE, x_AE.shape[0]), _tile(x_AE.shape[1]), _tile(g_AF.shape[1]))
    dw_xEF = kernels.tgmm(
        x_AE.swapaxes(0, 1), g_AF, sizes_X, jnp.float32, tiling, first, w_xEF.shape[0], interpret=interpret
    )
    return _zero_padding(dx_AE, rows), dw_xEF.astype(w_xEF.dtype), None, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def local_experts(x_NE, weights_NK, experts_NK, gate_xEM, up_xEM, down_xME, *, num_experts: int, first, interpret):
    """The "grouped" computation in the megablox kernels, over the x experts [first, first + x) of `num_experts`
    whose weights are given: tokens routed elsewhere contribute zero (another device adds them)."""
    N, K = experts_NK.shape
    A = N * K
    experts_A = experts_NK.reshape(-1)
    order_A = jnp.argsort(experts_A, stable=True)  # assignment index of each sorted row
    x_AE = jnp.take(x_NE, order_A // K, axis=0)  # assignment a belongs to token a // K
    sizes_X = jnp.bincount(experts_A, length=num_experts).astype(jnp.int32)
    tile = ROW_TILE if A >= ROW_TILE else -(-A // 8) * 8
    x_AE = jnp.pad(x_AE, ((0, -A % tile), (0, 0)))  # whole row tiles
    first = jnp.asarray(first, jnp.int32)
    gmm = functools.partial(_gmm, sizes_X=sizes_X, first=first, rows=A, interpret=interpret)
    h_AM = jax.nn.silu(gmm(x_AE, gate_xEM)) * gmm(x_AE, up_xEM)
    y_AE = gmm(h_AM, down_xME)[:A]
    y_NKE = jnp.zeros_like(y_AE).at[order_A].set(y_AE).reshape(N, K, -1)  # back to assignment order
    return jnp.einsum("nk,nke->ne", weights_NK.astype(y_NKE.dtype), y_NKE)


def _mesh_axes(target) -> tuple[str, ...]:
    return () if target is None else ((target,) if isinstance(target, str) else tuple(target))


def megablox_experts(x_NE, weights_NK, experts_NK, gate_XEM, up_XEM, down_XME, *, interpret: bool):
    """The megablox kernels for every expert projection (forward, input and weight gradients). On
    a mesh (`jax.set_mesh`, with the logical rules in context) this is expert parallelism: the
    tokens are split over the batch axes and the axes the experts (`expert`) and their width
    (`mlp`) are split over; the devices that share a batch shard, each holding other experts or
    another width slice, all-gather its tokens, each routes and sorts only those, computes its own
    experts' slice, and the partial outputs are reduce-scattered back to the devices the tokens
    came from. No device routes or multiplies another batch shard's tokens."""
    X = gate_XEM.shape[0]
    local = functools.partial(local_experts, num_experts=X, interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return local(x_NE, weights_NK, experts_NK, gate_XEM, up_XEM, down_XME, first=0)
    rules = dict(spmd.get_logical_axis_rules())
    if not rules:
        raise ValueError(
            "moe_dispatch='megablox' on a mesh of several devices needs the logical axis rules in context "
            "(`with nnx.logical_axis_rules(rules):`) to place its operands"
        )

    table = tuple(rules.items())
    placed = logical_to_spec(("expert", "embed", "mlp"), gate_XEM.shape, mesh, table)  # as the weights lie
    expert_axes, mlp_axes = _mesh_axes(placed[0]), _mesh_axes(placed[2])
    shared = expert_axes + mlp_axes  # devices along these hold one batch shard's tokens between them
    every = _mesh_axes(logical_to_spec(("batch",), (mesh.size,), mesh, table)[0])
    batch = tuple(a for a in every if a not in shared)
    tokens = batch + shared
    N = x_NE.shape[0]
    pad = -N % math.prod(mesh.shape[a] for a in tokens)  # padded tokens weigh 0
    x_NE, weights_NK, experts_NK = (jnp.pad(a, ((0, pad), (0, 0))) for a in (x_NE, weights_NK, experts_NK))
    per_block = X // math.prod(mesh.shape[a] for a in expert_axes)

    def block(x_nE, weights_nK, experts_nK, gate_xEM, up_xEM, down_xME):
        if shared:
            x_nE, weights_nK, experts_nK = (
                jax.lax.all_gather(a, shared, axis=0, tiled=True) for a in (x_nE, weights_nK, experts_nK)
            )
        index = jax.lax.axis_index(expert_axes) if expert_axes else 0
        y_nE = local(x_nE, weights_nK, experts_nK, gate_xEM, up_xEM, down_xME, first=index * per_block)
        return jax.lax.psum_scatter(y_nE, shared, scatter_dimension=0, tiled=True) if shared else y_nE

    row = PartitionSpec(tokens or None, None)
    expert, mlp = expert_axes or None, mlp_axes or None
    y_NE = jax.shard_map(
        block,
        mesh=mesh,
        in_specs=(
            row,
            row,
            row,
            PartitionSpec(expert, None, mlp),
            PartitionSpec(expert, None, mlp),
            PartitionSpec(expert, mlp, None),
        ),
        out_specs=row,
        check_vma=False,
    )(x_NE, weights_NK, experts_NK, gate_XEM, up_XEM, down_XME)
    return y_NE[:N]


_COMPUTE = {
    "dense": dense_experts,
    "grouped": grouped_experts,
    "megablox": functools.partial(megablox_experts, interpret=False),
    "megablox_interpret": functools.partial(megablox_experts, interpret=True),
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
