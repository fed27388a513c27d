"""The paged KV cache of the decode step: a pool of fixed-size pages shared by every slot, and the
attention that reads a slot's pages through its page table.

Shape letters: L layers (the pool is a tuple of one entry per layer), P pages in the pool, N rows
(tokens) per page, K kv heads, C = 2K combined kv heads, D head_dim, B slots, M pages per slot in
the page table, H query heads, R rows.

Layouts (`PagedKVCache`): "combined", for TPU: a layer is one [P, N, 2K', W] array holding each
token's keys and values interleaved by head (C index 2k = key head k, 2k + 1 = value head k),
the layout the ragged paged attention TPU kernel reads
(`jax.experimental.pallas.ops.tpu.ragged_paged_attention`); "split", elsewhere: a layer is a
(keys, values) pair of [P, N, K, D] arrays. The engine picks by its mesh's platform.
Heads narrower than the kernel's 128 lanes are packed in the combined layout: p = 128 / D
neighbouring kv heads share one row of W = p D lanes (K' = K / p; `lane_pack`), so a 64-wide head
(Qwen2.5-0.5B, Llama 3.2 1B) takes no more bytes than it holds. The kernel then sees K' kv heads of
width W; each query head is zero outside its own kv head's D lanes (`pack_queries`), so its scores
and softmax are exactly its own head's, and its output is read from those lanes (`unpack_outputs`).
Page 0 is the scratch page: no slot owns it; a page-table entry that points nowhere is 0, so a
free slot's garbage decode step and the padding rows of an insert write there and nowhere else.
Which page a slot holds is the host's business (`dora_jax.rollout.pages.PagePool`); programs only
read the page table they are given.

Attention over pages, for a decode step (one query per slot at `positions_B`, keys 0..position):
  * "reference": gathers the slot's pages into [B, M * N] rows and masks by position (any backend;
    work grows with M, which the engine sizes to the live pages: `rollout.engine`).
  * "pallas_tpu": the ragged paged attention kernel, for a combined pool whose rows are a
    multiple of 128 lanes wide (`uses_kernel`: heads 128 wide, or packed); it reads only the
    pages below each slot's length. On a mesh it runs under `shard_map`, heads over the rule
    table's `kv_heads` axis, slots over its `batch` axis.
The kernel cannot run in the Pallas interpreter on jax 0.10.2 (both interpreters fail inside it),
so on CPU its numbers are checked through the reference implementation it ships with
(`ref_ragged_paged_attention`, tests/models/test_paged.py) and it is compiled for TPU by
`dora_jax.tpu_compile`.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax.core import spmd
from jax.sharding import PartitionSpec

from dora_jax.models.attention import resolve_implementation
from dora_jax.parallel.sharding import logical_to_spec

PAGED_KV_AXES = (None, None, "kv_heads", "head_dim")  # each layer's pool [P, N, C, D]
SCRATCH_PAGE = 0
LANES = 128  # the TPU kernel's row width: a head's keys and values, its softmax statistics
# Kernel blocks that compile for TPU ahead of time (the tuned defaults ask for more VMEM than the
# compiler's scoped limit at 7B sizes): KV pages per block, queries per block, VMEM limit.
KERNEL_KV_PAGES_PER_BLOCK = 16
KERNEL_QUERIES_PER_BLOCK = 32
KERNEL_VMEM_LIMIT_BYTES = 64 * 1024 * 1024


@flax.struct.dataclass
class PagedKVCache:
    """The pool, one entry per layer (`kv`), and, for one program, every slot's page table
    (`page_table_BM`). A layer's entry is one [P, N, 2K, D] array in the kernel's layout
    ("combined", for TPU) or a pair of [P, N, K, D] arrays, keys and values ("split", elsewhere:
    on a CPU, gathering a slot's pages and slicing keys from values out of the combined layout
    cost 1.6 ms against 0.7 ms split, at 32 slots x 80 rows x 4 heads of 64). One buffer per
    layer, not one [L, ...] array: the TPU compiler updates a layer's buffer in place row by row,
    where a write into a stacked pool compiled into copies of the whole pool."""

    kv: tuple
    page_table_BM: jax.Array

    @property
    def page_size(self) -> int:
        return jax.tree.leaves(self.kv[0])[0].shape[1]


def lane_pack(num_kv_heads: int, head_dim: int, kv_shards: int = 1) -> int:
    """p: kv heads per row of the combined pool. 128 / head_dim for a head narrower than 128 lanes
    that divides them, when p x `kv_shards` (the devices the pool's heads are split over) divides
    num_kv_heads, so that every device holds whole rows of its own heads; else 1."""
    p = LANES // head_dim if head_dim < LANES and LANES % head_dim == 0 else 1
    return p if num_kv_heads % (p * kv_shards) == 0 else 1


def combined_layer_shape(
    num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, pack: int | None = None
) -> tuple[int, ...]:
    """[P, N, 2K', W]: one layer of the combined pool, `pack` heads to a row (default `lane_pack`)."""
    p = lane_pack(num_kv_heads, head_dim) if pack is None else pack
    return (num_pages, page_size, 2 * num_kv_heads // p, p * head_dim)


def pool_zeros(
    num_layers: int,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype,
    *,
    combined: bool = True,
    pack: int | None = None,
) -> tuple:
    """The empty pool: per layer one combined [P, N, 2K', W] array (`pack` heads to a row, default
    `lane_pack`), or a (keys, values) pair of [P, N, K, D]."""

    def layer():
        if combined:
            return jnp.zeros(combined_layer_shape(num_pages, page_size, num_kv_heads, head_dim, pack), dtype)
        return tuple(jnp.zeros((num_pages, page_size, num_kv_heads, head_dim), dtype) for _ in range(2))

    return tuple(layer() for _ in range(num_layers))


def interleave(k_XKD, v_XKD, width: int | None = None):
    """[..., K, D] keys and values -> [..., 2K', W] combined (2k keys, 2k + 1 values), rows
    `width` lanes wide (default D): W / D neighbouring heads share a row."""
    D = k_XKD.shape[-1]
    p = (width or D) // D
    k_XKW, v_XKW = (x.reshape(*x.shape[:-2], x.shape[-2] // p, p * D) for x in (k_XKD, v_XKD))
    kv = jnp.stack([k_XKW, v_XKW], axis=-2)
    return kv.reshape(*k_XKW.shape[:-2], 2 * k_XKW.shape[-2], k_XKW.shape[-1])


def split_kv(kv_XCD, head_dim: int | None = None):
    """[..., 2K', W] combined -> ([..., K, D] keys, [..., K, D] values): rows of W lanes unpacked
    into heads `head_dim` wide (default W)."""
    W = kv_XCD.shape[-1]
    kv = kv_XCD.reshape(*kv_XCD.shape[:-2], kv_XCD.shape[-2] // 2, 2, W)
    D = head_dim or W
    return tuple(x.reshape(*x.shape[:-2], x.shape[-2] * (W // D), D) for x in (kv[..., 0, :], kv[..., 1, :]))


def pack_queries(q_BHD, num_kv_heads: int, width: int):
    """[B, H, D] -> [B, H, W]: each query head in its kv head's D lanes of a packed row (zeros in
    the others, which then add nothing to its scores)."""
    B, H, D = q_BHD.shape
    part_H = (jnp.arange(H) // (H // num_kv_heads)) % (width // D)
    onehot_HP = jax.nn.one_hot(part_H, width // D, dtype=q_BHD.dtype)
    return (q_BHD[:, :, None, :] * onehot_HP[None, :, :, None]).reshape(B, H, width)


def unpack_outputs(out_BHW, num_kv_heads: int, head_dim: int):
    """[B, H, W] -> [B, H, D]: each head's output from its kv head's lanes (the others weigh the
    other heads' values)."""
    B, H, W = out_BHW.shape
    part_H = (jnp.arange(H) // (H // num_kv_heads)) % (W // head_dim)
    return out_BHW.reshape(B, H, W // head_dim, head_dim)[:, jnp.arange(H), part_H]


def write_token(layer_kv, k_BKD, v_BKD, page_table_BM, positions_B):
    """One layer's pool with each slot's new token written at its position: row position % N of
    page page_table[b, position // N] (the last column for a position past the table: only a free
    slot's, whose row is all scratch). Combined (TPU): a loop of one-row in-place updates (a
    scatter of [B, C, D] rows compiled there into a copy of the layer's pool per step). Split: one
    scatter each for keys and values (on a CPU a loop iteration costs more than that copy)."""
    N = jax.tree.leaves(layer_kv)[0].shape[1]
    M = page_table_BM.shape[1]
    column_B = jnp.minimum(positions_B // N, M - 1)
    page_B = jnp.take_along_axis(page_table_BM, column_B[:, None], axis=1)[:, 0]
    row_B = positions_B % N
    if isinstance(layer_kv, tuple):
        return tuple(
            pool.at[page_B, row_B].set(new.astype(pool.dtype), mode="promise_in_bounds")
            for pool, new in zip(layer_kv, (k_BKD, v_BKD))
        )
    rows_BCD = interleave(k_BKD, v_BKD, layer_kv.shape[-1]).astype(layer_kv.dtype)

    def put(b, kv):
        row = jax.lax.dynamic_index_in_dim(rows_BCD, b, 0, keepdims=True)[None]  # [1, 1, C, D]
        return jax.lax.dynamic_update_slice(kv, row, (page_B[b], row_B[b], 0, 0))

    return jax.lax.fori_loop(0, rows_BCD.shape[0], put, layer_kv)


def write_rows(kv: tuple, k_LRKD, v_LRKD, pages_Q) -> tuple:
    """The pool with R rows of one sequence written into its pages: rows q*N..(q+1)*N-1 into page
    pages_Q[q] of every layer (R = Q * N; a page of 0 takes padding rows into the scratch page)."""
    N = jax.tree.leaves(kv[0])[0].shape[1]

    def pages(rows_LRXD):  # [L, R, X, D] -> [L, Q, N, X, D]
        return rows_LRXD.reshape(rows_LRXD.shape[0], -1, N, *rows_LRXD.shape[2:])

    def combined(kv_PNCD, rows_QNCD):
        def put(q, pool):
            page = jax.lax.dynamic_index_in_dim(rows_QNCD, q, 0, keepdims=True)
            return jax.lax.dynamic_update_slice(pool, page, (pages_Q[q], 0, 0, 0))

        return jax.lax.fori_loop(0, rows_QNCD.shape[0], put, kv_PNCD.astype(kv_PNCD.dtype))

    if isinstance(kv[0], tuple):
        k_LQNKD, v_LQNKD = pages(k_LRKD), pages(v_LRKD)
        return tuple(
            (k.at[pages_Q].set(k_LQNKD[i].astype(k.dtype)), v.at[pages_Q].set(v_LQNKD[i].astype(v.dtype)))
            for i, (k, v) in enumerate(kv)
        )
    rows_LQNCD = pages(interleave(k_LRKD, v_LRKD, kv[0].shape[-1]).astype(kv[0].dtype))
    return tuple(combined(kv_PNCD, rows_LQNCD[i]) for i, kv_PNCD in enumerate(kv))


def read_rows(kv: tuple, pages_Q, head_dim: int | None = None):
    """(k_LRKD, v_LRKD): the Q pages' rows of every layer in order (R = Q * N); a combined pool's
    rows unpacked into heads `head_dim` wide (default: its row width)."""
    Q = pages_Q.shape[0]
    if isinstance(kv[0], tuple):
        k, v = (jnp.stack([layer[i][pages_Q] for layer in kv]) for i in range(2))
        return k.reshape(k.shape[0], -1, *k.shape[3:]), v.reshape(v.shape[0], -1, *v.shape[3:])

    def layer(kv_PNCD):
        def get(q, out):
            page = jax.lax.dynamic_slice_in_dim(kv_PNCD, pages_Q[q], 1, axis=0)
            return jax.lax.dynamic_update_slice_in_dim(out, page, q, axis=0)

        out = jnp.zeros((Q,) + kv_PNCD.shape[1:], kv_PNCD.dtype)
        return jax.lax.fori_loop(0, Q, get, out).reshape(Q * kv_PNCD.shape[1], *kv_PNCD.shape[2:])

    return split_kv(jnp.stack([layer(kv_PNCD) for kv_PNCD in kv]), head_dim)


def attend(q_BHD, layer_kv, page_table_BM, positions_B, *, implementation: str = "auto"):
    """One query per slot (at `positions_B`) over the slot's keys 0..position; out_BHD."""
    combined = not isinstance(layer_kv, tuple)
    if combined and uses_kernel(implementation, q_BHD.dtype, layer_kv.shape[-1]):
        return _kernel_on_mesh(q_BHD, layer_kv, page_table_BM, positions_B)
    return reference_attend(q_BHD, layer_kv, page_table_BM, positions_B)


def uses_kernel(implementation: str, dtype, width: int, backend: str | None = None) -> bool:
    """Whether `attend` runs the TPU kernel on a combined pool whose rows are `width` lanes wide:
    where `implementation` resolves to "pallas_tpu" and the rows fill the kernel's 128 lanes (its
    softmax statistics are 128 lanes wide: an unpacked 64-wide head fails inside it). A pool of
    heads narrower than that packs them (`lane_pack`); one that cannot attends with the reference."""
    return resolve_implementation(implementation, dtype, backend) == "pallas_tpu" and width % LANES == 0


def reference_attend(q_BHD, layer_kv, page_table_BM, positions_B):
    """Gathers every slot's M pages and attends over them, masked by position: softmax(q k^T /
    sqrt(D)) v with float32 scores, probabilities in the value dtype (as `reference_attention`)."""
    B, M = page_table_BM.shape
    H, D = q_BHD.shape[1:]
    if isinstance(layer_kv, tuple):
        k_BSKD, v_BSKD = (pool[page_table_BM].reshape(B, -1, *pool.shape[2:]) for pool in layer_kv)
    else:
        k_BSKD, v_BSKD = split_kv(layer_kv[page_table_BM].reshape(B, -1, *layer_kv.shape[2:]), D)
    S, K = k_BSKD.shape[1:3]
    dt = q_BHD.dtype
    q_BKGD = q_BHD.reshape(B, K, H // K, D)
    scores_BKGS = jnp.einsum("bkgd,bskd->bkgs", q_BKGD, k_BSKD.astype(dt), preferred_element_type=jnp.float32)
    mask_B11S = (jnp.arange(S, dtype=positions_B.dtype)[None, :] <= positions_B[:, None])[:, None, None]
    scores_BKGS = jnp.where(mask_B11S, scores_BKGS * (D**-0.5), jnp.finfo(jnp.float32).min)
    probs_BKGS = jax.nn.softmax(scores_BKGS, axis=-1).astype(dt)
    return jnp.einsum("bkgs,bskd->bkgd", probs_BKGS, v_BSKD.astype(dt)).reshape(B, H, D)


def kernel_attend(q_BHD, kv_PNCD, page_table_BM, positions_B, *, reference: bool = False):
    """The ragged paged attention TPU kernel on one device's share: every slot one query token.
    Narrow heads packed in the pool's rows go in and come out through `pack_queries` /
    `unpack_outputs`. `reference=True` runs the reference implementation that ships with the kernel
    on the same (packed) inputs instead: how its numbers are checked on a CPU."""
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa  # TPU only: import when used

    B, M = page_table_BM.shape
    N, W = kv_PNCD.shape[1], kv_PNCD.shape[-1]
    D = q_BHD.shape[-1]
    K = kv_PNCD.shape[2] // 2 * (W // D)  # kv heads on this device, unpacked
    # A free slot (its first page the scratch page: an occupied slot holds a real one) reads one
    # row, not the positions its garbage steps have counted up to.
    live_B = page_table_BM[:, 0] != SCRATCH_PAGE
    lengths_B = jnp.where(live_B, jnp.minimum(positions_B + 1, M * N), 1).astype(jnp.int32)
    args = (
        pack_queries(q_BHD, K, W) if W != D else q_BHD,
        kv_PNCD.astype(q_BHD.dtype),
        lengths_B,
        page_table_BM.astype(jnp.int32),
        jnp.arange(B + 1, dtype=jnp.int32),
        jnp.array([B], jnp.int32),
    )
    if reference:
        out = rpa.ref_ragged_paged_attention(*args, sm_scale=D**-0.5)
    else:
        out = rpa.ragged_paged_attention(
            *args,
            sm_scale=D**-0.5,
            num_kv_pages_per_block=min(KERNEL_KV_PAGES_PER_BLOCK, M),
            num_queries_per_block=KERNEL_QUERIES_PER_BLOCK,
            vmem_limit_bytes=KERNEL_VMEM_LIMIT_BYTES,
        )
    return unpack_outputs(out, K, D) if W != D else out


def _kernel_on_mesh(q_BHD, kv_PNCD, page_table_BM, positions_B):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return kernel_attend(q_BHD, kv_PNCD, page_table_BM, positions_B)
    rules = dict(spmd.get_logical_axis_rules())
    if not rules:
        raise ValueError(
            "the paged attention kernel on a mesh of several devices needs the logical axis rules in "
            "context (`with nnx.logical_axis_rules(rules):`) to place its operands"
        )
    heads, kv_heads = rules.get("heads"), rules.get("kv_heads")
    batch = logical_to_spec(("batch",), (q_BHD.shape[0],), mesh, tuple(rules.items()))[0]
    sharded = jax.shard_map(
        kernel_attend,
        mesh=mesh,
        in_specs=(
            PartitionSpec(batch, heads, None),
            PartitionSpec(None, None, kv_heads, None),
            PartitionSpec(batch, None),
            PartitionSpec(batch),
        ),
        out_specs=PartitionSpec(batch, heads, None),
        check_vma=False,
    )
    return sharded(q_BHD, kv_PNCD, page_table_BM, positions_B)
