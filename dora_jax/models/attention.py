"""Causal self-attention for the decoder's full forward: one function, the kernel picked by backend.

Shape letters: B batch, T query time, S key time, H query heads, K kv heads, G = H / K query heads
per kv head, D head_dim.

Implementations (`ModelConfig.attention`), all with the same maths (softmax(q k^T / sqrt(D)) v,
causal, grouped-query):
  * "reference": einsum scores in float32, masked by position, softmax, probabilities cast to the
    value dtype. Any backend; the KV-cached path (prefill into a cache, decode) always uses it.
  * "xla": `jax.nn.dot_product_attention(implementation="xla")`.
  * "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN's fused flash
    attention (GPU, 16-bit compute dtypes).
  * "pallas_tpu": the splash attention Pallas kernel (`jax.experimental.pallas.ops.tpu`); the
    length is padded to a multiple of its 128-wide blocks (padded keys come after every real query,
    so the causal mask hides them) and cut back.
  * "pallas_interpret": the same kernel run by the Pallas interpreter, on any backend (slow: tests).
  * "auto": "pallas_tpu" on TPU, "cudnn" on GPU with a 16-bit compute dtype (else "xla"),
    "reference" on CPU. Resolved from `jax.default_backend()` when traced, so an ahead-of-time
    compile for TPU devices from a CPU host must name "pallas_tpu" itself.
A Pallas kernel cannot be partitioned by XLA: on more than one device it runs under `shard_map`
over the mesh the driver sets (`jax.set_mesh`), its q/k/v specs the logical names ("batch",
"length", "heads" | "kv_heads", "head_dim") through the rule table in context
(`nnx.logical_axis_rules`), the length kept whole. So "auto" picks the kernel on TPU only with one
device or with such a mesh in context, and the reference otherwise.
The reference masks by position (key position <= query position); the kernels mask by index,
which is the same thing for a full forward, whose positions increase along each row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax.core import spmd
from jax.sharding import PartitionSpec

from dora_jax.models.config import ATTENTION_IMPLEMENTATIONS
from dora_jax.parallel.sharding import logical_to_spec

_SPLASH_BLOCKS = (512, 256, 128)  # the widest that divides the padded length; 128 = one lane row


def resolve_implementation(implementation: str, dtype, backend: str | None = None) -> str:
    """The concrete implementation "auto" stands for on `backend` (default: JAX's default backend)."""
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"attention={implementation!r}; expected one of {ATTENTION_IMPLEMENTATIONS}")
    if implementation != "auto":
        return implementation
    backend = backend or jax.default_backend()
    if backend == "tpu":
        mesh = jax.sharding.get_abstract_mesh()
        can_shard = not mesh.empty and bool(spmd.get_logical_axis_rules())
        return "pallas_tpu" if can_shard or jax.device_count() == 1 else "reference"
    if backend == "gpu":
        return "cudnn" if jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) else "xla"
    return "reference"


def causal_attention(q_BTHD, k_BTKD, v_BTKD, positions_BT, *, implementation: str = "auto"):
    """Causal attention of T queries over the same T keys; returns out_BTHD in the value dtype."""
    impl = resolve_implementation(implementation, q_BTHD.dtype)
    if impl == "reference":
        mask_BTS = positions_BT[:, None, :] <= positions_BT[:, :, None]
        return reference_attention(q_BTHD, k_BTKD, v_BTKD, mask_BTS)
    if impl in ("xla", "cudnn"):
        return jax.nn.dot_product_attention(q_BTHD, k_BTKD, v_BTKD, is_causal=True, implementation=impl)
    kernel = functools.partial(splash_attention, interpret=impl == "pallas_interpret")
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return kernel(q_BTHD, k_BTKD, v_BTKD)
    q_spec, kv_spec = _mesh_spec("heads", q_BTHD.shape[0]), _mesh_spec("kv_heads", q_BTHD.shape[0])
    sharded = jax.shard_map(kernel, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec, check_vma=False)
    return sharded(q_BTHD, k_BTKD, v_BTKD)


def _mesh_spec(heads: str, rows: int) -> PartitionSpec:
    """The mesh PartitionSpec of a [B, T, heads, D] kernel operand from the logical rules in context
    (rows over the batch rule's leading mesh axes that divide them)."""
    rules = dict(spmd.get_logical_axis_rules())
    if not rules:
        raise ValueError(
            "a Pallas attention kernel on a mesh of several devices needs the logical axis rules in "
            "context (`with nnx.logical_axis_rules(rules):`) to place its operands"
        )
    batch = logical_to_spec(("batch",), (rows,), jax.sharding.get_abstract_mesh(), tuple(rules.items()))[0]
    return PartitionSpec(batch, None, rules.get(heads), None)


def reference_attention(q_BTHD, k_BSKD, v_BSKD, mask_BTS):
    """softmax(q k^T / sqrt(D)) v under an explicit mask; float32 scores, any backend."""
    B, T, H, D = q_BTHD.shape
    K = k_BSKD.shape[2]
    q_BTKGD = q_BTHD.reshape(B, T, K, H // K, D)
    scores_BKGTS = jnp.einsum("btkgd,bskd->bkgts", q_BTKGD, k_BSKD, preferred_element_type=jnp.float32)
    scores_BKGTS = scores_BKGTS * (D**-0.5)
    scores_BKGTS = jnp.where(mask_BTS[:, None, None], scores_BKGTS, jnp.finfo(jnp.float32).min)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1).astype(v_BSKD.dtype)
    out_BTKGD = jnp.einsum("bkgts,bskd->btkgd", probs_BKGTS, v_BSKD)
    return out_BTKGD.reshape(B, T, H, D)


def splash_attention(q_BTHD, k_BTKD, v_BTKD, *, interpret: bool = False):
    """The TPU splash kernel, causal, grouped-query (the kernel maps query head h to kv head h // G),
    vmapped over the batch. The kernel does not scale the scores: q is scaled by 1/sqrt(D) first."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash  # ~1 s of import: only when used

    B, T, H, D = q_BTHD.shape
    padded = -(-T // 128) * 128
    block = next(b for b in _SPLASH_BLOCKS if padded % b == 0)

    def heads_first(x_BTND):  # [B, N, padded, D]
        return jnp.pad(x_BTND.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, padded - T), (0, 0)))

    q_BHTD = heads_first(q_BTHD * jnp.asarray(D**-0.5, q_BTHD.dtype))
    mask = splash.MultiHeadMask([splash.CausalMask((padded, padded))] * H)
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)
    out_BHTD = jax.vmap(kernel)(q_BHTD, heads_first(k_BTKD), heads_first(v_BTKD))
    return out_BHTD[:, :, :T].transpose(0, 2, 1, 3).astype(v_BTKD.dtype)
