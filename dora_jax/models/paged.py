"""The paged KV cache of the decode step: a pool of fixed-size pages shared by every slot, and the
attention that reads a slot's pages through its page table.

Shape letters: L layers, P pages in the pool, N rows (tokens) per page, K kv heads, C = 2K combined
kv heads, D head_dim, B slots, M pages per slot in the page table, H query heads, R rows.

Layout: `kv_LPNCD[l, p, n]` holds one token's keys and values interleaved by head (C index 2k =
key head k, 2k + 1 = value head k), the layout the ragged paged attention TPU kernel reads
(`jax.experimental.pallas.ops.tpu.ragged_paged_attention`), so the kernel reads the pool as it is.
Page 0 is the scratch page: no slot owns it; a page-table entry that points nowhere is 0, so a
free slot's garbage decode step and the padding rows of an insert write there and nowhere else.
Which page a slot holds is the host's business (`dora_jax.rollout.pages.PagePool`); programs only
read the page table they are given.

Attention over pages, for a decode step (one query per slot at `positions_B`, keys 0..position):
  * "reference": gathers the slot's pages into [B, M * N] rows and masks by position (any backend;
    work grows with M, which the engine sizes to the live pages: `rollout.engine`).
  * "pallas_tpu": the ragged paged attention kernel; it reads only the pages below each slot's
    length. On a mesh it runs under `shard_map`, heads over the rule table's `kv_heads` axis,
    slots over its `batch` axis.
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

from dora_jax.models.attention import reference_attention, resolve_implementation

PAGED_KV_AXES = ("layers", None, None, "kv_heads", "head_dim")
SCRATCH_PAGE = 0
# Kernel blocks that compile for TPU ahead of time (the tuned defaults ask for more VMEM than the
# compiler's scoped limit at 7B sizes): KV pages per block, queries per block, VMEM limit.
KERNEL_KV_PAGES_PER_BLOCK = 16
KERNEL_QUERIES_PER_BLOCK = 32
KERNEL_VMEM_LIMIT_BYTES = 64 * 1024 * 1024


@flax.struct.dataclass
class PagedKVCache:
    """The pool (`kv_LPNCD`) and, for one program, the page table of every slot (`page_table_BM`)."""

    kv_LPNCD: jax.Array
    page_table_BM: jax.Array

    @property
    def page_size(self) -> int:
        return self.kv_LPNCD.shape[2]


def pool_zeros(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype):
    return jnp.zeros((num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim), dtype)


def interleave(k_XKD, v_XKD):
    """[..., K, D] keys and values -> [..., 2K, D] combined (2k keys, 2k + 1 values)."""
    kv = jnp.stack([k_XKD, v_XKD], axis=-2)
    return kv.reshape(*k_XKD.shape[:-2], 2 * k_XKD.shape[-2], k_XKD.shape[-1])


def split_kv(kv_XCD):
    """[..., 2K, D] combined -> ([..., K, D] keys, [..., K, D] values)."""
    kv = kv_XCD.reshape(*kv_XCD.shape[:-2], kv_XCD.shape[-2] // 2, 2, kv_XCD.shape[-1])
    return kv[..., 0, :], kv[..., 1, :]


def write_token(kv_LPNCD, layer: int, k_BKD, v_BKD, page_table_BM, positions_B):
    """The pool with each slot's new token written at its position in `layer`: row position % N of
    page page_table[b, position // N] (the last column for a position past the table: only a free
    slot's, whose row is all scratch)."""
    N, M = kv_LPNCD.shape[2], page_table_BM.shape[1]
    column_B = jnp.minimum(positions_B // N, M - 1)
    page_B = jnp.take_along_axis(page_table_BM, column_B[:, None], axis=1)[:, 0]
    rows = interleave(k_BKD, v_BKD).astype(kv_LPNCD.dtype)
    return kv_LPNCD.at[layer, page_B, positions_B % N].set(rows)


def write_rows(kv_LPNCD, k_LRKD, v_LRKD, pages_Q):
    """The pool with R rows of one sequence written into its pages: rows q*N..(q+1)*N-1 into page
    pages_Q[q] (R = Q * N; a page of 0 takes padding rows into the scratch page)."""
    L, R = k_LRKD.shape[:2]
    N = kv_LPNCD.shape[2]
    rows = interleave(k_LRKD, v_LRKD).astype(kv_LPNCD.dtype).reshape(L, R // N, N, *kv_LPNCD.shape[3:])
    return kv_LPNCD.at[:, pages_Q].set(rows)


def read_rows(kv_LPNCD, pages_Q):
    """(k_LRKD, v_LRKD): the Q pages' rows in order (R = Q * N)."""
    kv = kv_LPNCD[:, pages_Q]
    kv = kv.reshape(kv.shape[0], -1, *kv.shape[3:])
    return split_kv(kv)


def attend(q_BHD, kv_PNCD, page_table_BM, positions_B, *, implementation: str = "auto"):
    """One query per slot (at `positions_B`) over the slot's keys 0..position; out_BHD."""
    impl = resolve_implementation(implementation, q_BHD.dtype)
    if impl == "pallas_tpu":
        return _kernel_on_mesh(q_BHD, kv_PNCD, page_table_BM, positions_B)
    return reference_attend(q_BHD, kv_PNCD, page_table_BM, positions_B)


def reference_attend(q_BHD, kv_PNCD, page_table_BM, positions_B):
    """Gathers every slot's M pages and attends with the dense reference, masked by position."""
    B, M = page_table_BM.shape
    N = kv_PNCD.shape[1]
    k_BSKD, v_BSKD = split_kv(kv_PNCD[page_table_BM].reshape(B, M * N, *kv_PNCD.shape[2:]))
    mask_B1S = (jnp.arange(M * N, dtype=positions_B.dtype)[None, :] <= positions_B[:, None])[:, None]
    dt = q_BHD.dtype
    return reference_attention(q_BHD[:, None], k_BSKD.astype(dt), v_BSKD.astype(dt), mask_B1S)[:, 0]


def kernel_attend(q_BHD, kv_PNCD, page_table_BM, positions_B):
    """The ragged paged attention TPU kernel on one device's share: every slot one query token."""
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa  # TPU only: import when used

    B, M = page_table_BM.shape
    N = kv_PNCD.shape[1]
    lengths_B = jnp.minimum(positions_B + 1, M * N).astype(jnp.int32)
    return rpa.ragged_paged_attention(
        q_BHD,
        kv_PNCD.astype(q_BHD.dtype),
        lengths_B,
        page_table_BM.astype(jnp.int32),
        jnp.arange(B + 1, dtype=jnp.int32),
        jnp.array([B], jnp.int32),
        sm_scale=q_BHD.shape[-1] ** -0.5,
        num_kv_pages_per_block=min(KERNEL_KV_PAGES_PER_BLOCK, M),
        num_queries_per_block=KERNEL_QUERIES_PER_BLOCK,
        vmem_limit_bytes=KERNEL_VMEM_LIMIT_BYTES,
    )


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
    batch, heads, kv_heads = rules.get("batch"), rules.get("heads"), rules.get("kv_heads")
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
