"""The paged KV cache's programs: attention over pages against the reference implementation that
ships with the ragged paged attention TPU kernel, row writes and reads round trip, and a decode
step over pages equals the dense cached decode step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa

from dora_jax.models import KVCache, ModelConfig, PagedKVCache, init_model, paged


def _pool(P, N, K, D, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=(P, N, 2 * K, D)), jnp.float32)


@pytest.mark.parametrize("combined", [True, False])
def test_reference_attention_over_pages_equals_the_kernels_own_reference(combined):
    B, H, K, D, N, P, M = 4, 6, 2, 16, 8, 40, 5
    rng = np.random.default_rng(1)
    q_BHD = jnp.asarray(rng.normal(size=(B, H, D)), jnp.float32)
    kv_PNCD = _pool(P, N, K, D)
    table_BM = jnp.asarray(rng.permutation(np.arange(1, P))[: B * M].reshape(B, M), jnp.int32)
    positions_B = jnp.array([0, 7, 8, 39], jnp.int32)  # a first token, a page's last row, a new page, the end
    layer = kv_PNCD if combined else paged.split_kv(kv_PNCD)  # the same pool as (keys, values)
    ours = paged.reference_attend(q_BHD, layer, table_BM, positions_B)
    theirs = rpa.ref_ragged_paged_attention(
        q_BHD,
        kv_PNCD,
        positions_B + 1,
        table_BM,
        jnp.arange(B + 1, dtype=jnp.int32),
        jnp.array([B], jnp.int32),
        sm_scale=D**-0.5,
    )
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("K,D,packed", [(2, 64, 2), (4, 32, 4), (2, 32, 1), (1, 128, 1)])
def test_narrow_heads_packed_into_128_lane_rows_attend_as_unpacked(K, D, packed):
    """A combined pool packs 128 / D neighbouring kv heads into one row of 128 lanes (as many as
    divide K): the same bytes, rows the TPU kernel takes. Rows written and a token's write read back
    as the heads they were; the reference over the packed pool, and the kernel's own reference
    implementation on the packed queries and pool (`kernel_attend(reference=True)`, what the kernel
    computes), equal the reference over the unpacked pool, GQA (2 query heads per kv head)
    included."""
    B, H, N, P, M = 4, 2 * K, 8, 24, 3
    assert paged.lane_pack(K, D) == packed
    # Split over devices, each device's rows hold its own heads only: packing needs p x shards | K.
    assert paged.lane_pack(K, D, kv_shards=2) == (packed if K % (2 * packed) == 0 else 1)
    assert paged.combined_layer_shape(P, N, K, D) == (P, N, 2 * K // packed, packed * D)
    rng = np.random.default_rng(5)
    k, v = (jnp.asarray(rng.normal(size=(1, M * N, K, D)), jnp.float32) for _ in range(2))
    pools = {combined: paged.pool_zeros(1, P, N, K, D, jnp.float32, combined=combined) for combined in (True, False)}
    table_BM = jnp.asarray(rng.permutation(np.arange(1, P))[: B * M].reshape(B, M), jnp.int32)
    for b in range(B):  # every slot holds the same rows, in its own pages
        pools = {c: paged.write_rows(kv, k, v, table_BM[b]) for c, kv in pools.items()}
    positions_B = jnp.array([0, 7, 8, 20], jnp.int32)
    new_k, new_v = (jnp.asarray(rng.normal(size=(B, K, D)), jnp.float32) for _ in range(2))
    pools = {c: (paged.write_token(kv[0], new_k, new_v, table_BM, positions_B),) for c, kv in pools.items()}
    packed_pool, split_pool = pools[True][0], pools[False][0]
    assert packed_pool.shape == (P, N, 2 * K // packed, packed * D)
    for b in range(B):
        k_back, v_back = paged.read_rows(pools[True], table_BM[b], D)
        expect_k = k[0].at[positions_B[b]].set(new_k[b])
        expect_v = v[0].at[positions_B[b]].set(new_v[b])
        np.testing.assert_array_equal(np.asarray(k_back[0]), np.asarray(expect_k))
        np.testing.assert_array_equal(np.asarray(v_back[0]), np.asarray(expect_v))
    q_BHD = jnp.asarray(rng.normal(size=(B, H, D)), jnp.float32)
    unpacked = paged.reference_attend(q_BHD, split_pool, table_BM, positions_B)
    np.testing.assert_allclose(
        np.asarray(paged.reference_attend(q_BHD, packed_pool, table_BM, positions_B)), np.asarray(unpacked), atol=1e-6
    )
    kernel_math = paged.kernel_attend(q_BHD, packed_pool, table_BM, positions_B, reference=True)
    np.testing.assert_allclose(np.asarray(kernel_math), np.asarray(unpacked), atol=1e-5, rtol=1e-5)
    assert paged.uses_kernel("pallas_tpu", jnp.bfloat16, packed_pool.shape[-1]) == (packed * D % 128 == 0)


@pytest.mark.parametrize("combined", [True, False])
def test_rows_written_into_pages_read_back_in_order_and_padding_goes_to_scratch(combined):
    L, K, D, N, P = 2, 2, 4, 4, 10
    kv = paged.pool_zeros(L, P, N, K, D, jnp.float32, combined=combined)
    rng = np.random.default_rng(2)
    k, v = (jnp.asarray(rng.normal(size=(L, 12, K, D)), jnp.float32) for _ in range(2))
    pages = jnp.array([7, 3, 0], jnp.int32)  # two real pages, then the padding rows 8..11 to scratch
    kv = jax.jit(paged.write_rows)(kv, k, v, pages)
    k_back, v_back = jax.jit(paged.read_rows)(kv, jnp.array([7, 3], jnp.int32))
    np.testing.assert_array_equal(np.asarray(k_back), np.asarray(k[:, :8]))
    np.testing.assert_array_equal(np.asarray(v_back), np.asarray(v[:, :8]))
    untouched = [p for p in range(1, P) if p not in (7, 3)]
    assert not any(np.asarray(array)[untouched].any() for array in jax.tree.leaves(kv))
    # Page 7 holds rows 0..3: combined, keys at even heads and values at odd ones.
    keys, values = (kv[1][7, :, 0::2], kv[1][7, :, 1::2]) if combined else (kv[1][0][7], kv[1][1][7])
    np.testing.assert_array_equal(np.asarray(keys), np.asarray(k[1, :4]))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(v[1, :4]))


@pytest.mark.parametrize("combined", [True, False])
def test_a_decode_write_lands_in_each_slots_page_and_row(combined):
    K, D, N, P = 1, 2, 4, 6
    kv = paged.pool_zeros(1, P, N, K, D, jnp.float32, combined=combined)[0]
    table = jnp.array([[2, 5], [4, 1], [0, 0]], jnp.int32)  # slot 2 is free: its row is all scratch
    positions = jnp.array([1, 6, 30], jnp.int32)  # page 2 row 1; page 1 row 2; past the table
    k = jnp.arange(3 * K * D, dtype=jnp.float32).reshape(3, K, D) + 1
    kv = jax.jit(paged.write_token)(kv, k, -k, table, positions)
    keys, values = (kv[..., 0::2, :], kv[..., 1::2, :]) if combined else kv
    np.testing.assert_array_equal(np.asarray(keys[2, 1]), np.asarray(k[0]))
    np.testing.assert_array_equal(np.asarray(values[1, 2]), -np.asarray(k[1]))
    np.testing.assert_array_equal(np.asarray(keys[0, 2]), np.asarray(k[2]))  # the free slot: scratch
    assert sum(int((np.asarray(a) != 0).sum()) for a in jax.tree.leaves(kv)) == 3 * 2 * D


@pytest.mark.parametrize(
    "combined,head_dim", [(True, 16), (False, 16), (True, 64)], ids=["combined", "split", "packed"]
)
def test_a_paged_decode_step_equals_the_dense_cached_decode_step(combined, head_dim):
    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        intermediate_size=128,
    )
    model = init_model(cfg, seed=3)
    B, S, N = 3, 16, 4
    prompt_lengths = [5, 9, 12]
    rng = np.random.default_rng(4)
    ids = rng.integers(0, cfg.vocab_size, size=(B, S))
    dense = KVCache.zeros(cfg, batch=B, length=S)
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    _, dense = model(jnp.asarray(ids), positions, cache=dense)  # every row's keys 0..S-1
    # The same rows in pages, each slot's pages scattered through the pool (page 0: scratch).
    table = np.array([[5, 2, 9, 1], [3, 8, 4, 6], [7, 11, 10, 12]], np.int32)
    kv = paged.pool_zeros(cfg.num_layers, 13, N, cfg.num_kv_heads, cfg.head_dim, cfg.dtype, combined=combined)
    for b in range(B):
        kv = paged.write_rows(kv, dense.k_LBSKD[:, b], dense.v_LBSKD[:, b], jnp.asarray(table[b]))
    pages = PagedKVCache(kv, jnp.asarray(table))
    tokens = jnp.asarray(ids[np.arange(B), prompt_lengths])[:, None]
    at = jnp.asarray(prompt_lengths, jnp.int32)[:, None]
    dense_logits, dense = jax.jit(lambda t, p, c: model(t, p, cache=c))(tokens, at, dense)
    paged_logits, pages = jax.jit(lambda t, p, c: model(t, p, cache=c))(tokens, at, pages)
    np.testing.assert_allclose(np.asarray(paged_logits), np.asarray(dense_logits), atol=1e-5, rtol=1e-5)
    # The new token's keys landed at the same row in the slot's page.
    for b, position in enumerate(prompt_lengths):
        page, row = table[b, position // N], position % N
        for layer in range(cfg.num_layers):
            pool = pages.kv[layer]
            k_new = paged.split_kv(pool[page, row], head_dim)[0] if combined else pool[0][page, row]
            np.testing.assert_allclose(np.asarray(k_new), np.asarray(dense.k_LBSKD[layer, b, position]), atol=1e-6)
