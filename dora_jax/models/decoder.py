"""One flax.nnx decoder for Llama 3.x, Qwen2/2.5, Qwen3 (dense) and Qwen3-MoE.

Shape letters: B batch, T query time, S key/cache time, E embed (hidden), H query heads,
K kv heads, G = H / K query heads per kv head, D head_dim, M mlp, V vocab, L layers
(X experts, see dora_jax.models.moe).

Two call paths share every layer:
  * full forward: `model(input_ids_BT)` -> logits_BTV (training, log-probs);
  * cached: `model(input_ids_BT, positions_BT, cache=KVCache)` -> (logits_BTV, KVCache): the T new
    tokens' keys/values are written at their positions and attention reads the cache (prefill
    with T = prompt length, decode with T = 1);
  * paged: `model(input_ids_B1, positions_B1, cache=PagedKVCache)` -> (logits_B1V, PagedKVCache):
    a decode step over a pool of pages (dora_jax.models.paged).
The full forward's attention is `dora_jax.models.attention.causal_attention` (the kernel picked by
backend, `ModelConfig.attention`); the cached path attends over the cache with the reference.
A full forward with `return_routing=True` also returns each MoE layer's `Routing` (router
probabilities and chosen experts), for router metrics and the load-balancing loss.
Every parameter carries logical axis names in its `out_sharding` metadata (`embed`, `heads`,
`kv_heads`, `head_dim`, `mlp`, `vocab`, `norm`, `expert`); `dora_jax.parallel.sharding` maps them to mesh axes.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from dora_jax.models import paged
from dora_jax.models.attention import causal_attention, reference_attention
from dora_jax.models.config import ModelConfig
from dora_jax.models.moe import MoE
from dora_jax.models.paged import PagedKVCache
from dora_jax.models.params import in_compute_dtype
from dora_jax.models.params import normal as _normal
from dora_jax.models.params import param as _param
from dora_jax.models.rope import apply_rope, inverse_frequencies
from dora_jax.parallel.sharding import constrain


@flax.struct.dataclass
class KVCache:
    """Per-layer keys/values after RoPE. `k_LBSKD`/`v_LBSKD`: [layers, batch, length, kv_heads, head_dim]."""

    k_LBSKD: jax.Array
    v_LBSKD: jax.Array

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, length: int, dtype=None) -> KVCache:
        shape = (config.num_layers, batch, length, config.num_kv_heads, config.head_dim)
        dtype = dtype or config.dtype
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @property
    def length(self) -> int:
        return self.k_LBSKD.shape[2]


KV_CACHE_AXES = ("layers", "batch", "length", "kv_heads", "head_dim")


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, param_dtype):
        self.eps = eps
        self.scale = _param(jnp.ones((dim,), param_dtype), ("norm",))

    def __call__(self, x):
        # fp32 statistics, as HF does, then back to the input dtype before the scale.
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x.dtype) * x32.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        E, H, K, D, pd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.param_dtype
        self.cfg = cfg
        self.q_EHD = _param(_normal(rngs, (E, H, D), pd), ("embed", "heads", "head_dim"))
        self.k_EKD = _param(_normal(rngs, (E, K, D), pd), ("embed", "kv_heads", "head_dim"))
        self.v_EKD = _param(_normal(rngs, (E, K, D), pd), ("embed", "kv_heads", "head_dim"))
        self.o_HDE = _param(_normal(rngs, (H, D, E), pd), ("heads", "head_dim", "embed"))
        if cfg.attention_bias:
            self.q_bias_HD = _param(jnp.zeros((H, D), pd), ("heads", "head_dim"))
            self.k_bias_KD = _param(jnp.zeros((K, D), pd), ("kv_heads", "head_dim"))
            self.v_bias_KD = _param(jnp.zeros((K, D), pd), ("kv_heads", "head_dim"))
        if cfg.attention_out_bias:
            self.o_bias_E = _param(jnp.zeros((E,), pd), ("embed",))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps, pd)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps, pd)

    def __call__(self, x_BTE, positions_BT, cache: tuple | PagedKVCache | None = None, layer: int = 0):
        """With `cache` = (k_LBSKD, v_LBSKD), writes this layer's new rows into the stacked cache
        (a scatter XLA does in place when the caller donates the cache) and returns it whole; with a
        PagedKVCache (one token per row), writes into the slots' pages and attends over them."""
        cfg, dt = self.cfg, self.cfg.dtype
        q_BTHD = jnp.einsum("bte,ehd->bthd", x_BTE, self.q_EHD[...].astype(dt))
        k_BTKD = jnp.einsum("bte,ekd->btkd", x_BTE, self.k_EKD[...].astype(dt))
        v_BTKD = jnp.einsum("bte,ekd->btkd", x_BTE, self.v_EKD[...].astype(dt))
        if cfg.attention_bias:
            q_BTHD = q_BTHD + self.q_bias_HD[...].astype(dt)
            k_BTKD = k_BTKD + self.k_bias_KD[...].astype(dt)
            v_BTKD = v_BTKD + self.v_bias_KD[...].astype(dt)
        if cfg.qk_norm:
            q_BTHD, k_BTKD = self.q_norm(q_BTHD), self.k_norm(k_BTKD)
        inv_freq_F = inverse_frequencies(cfg.rope, cfg.head_dim)  # a host constant, folded by XLA
        q_BTHD = apply_rope(q_BTHD, positions_BT, inv_freq_F)
        k_BTKD = apply_rope(k_BTKD, positions_BT, inv_freq_F)
        q_BTHD = constrain(q_BTHD, ("batch", "length", "heads", "head_dim"))
        k_BTKD = constrain(k_BTKD, ("batch", "length", "kv_heads", "head_dim"))
        v_BTKD = constrain(v_BTKD, ("batch", "length", "kv_heads", "head_dim"))

        if cache is None:  # full forward: causal over the T tokens themselves, the kernel by backend
            out_BTHD = causal_attention(
                q_BTHD, k_BTKD.astype(dt), v_BTKD.astype(dt), positions_BT, implementation=cfg.attention
            )
            new_cache = (k_BTKD, v_BTKD)
        elif isinstance(cache, PagedKVCache):  # a decode step: write each slot's token into its page
            if x_BTE.shape[1] != 1:
                raise ValueError(f"a paged KV cache takes one token per row (a decode step); got {x_BTE.shape[1]}")
            kv = list(cache.kv)
            kv[layer] = paged.write_token(
                kv[layer], k_BTKD[:, 0], v_BTKD[:, 0], cache.page_table_BM, positions_BT[:, 0]
            )
            out_BHD = paged.attend(
                q_BTHD[:, 0], kv[layer], cache.page_table_BM, positions_BT[:, 0], implementation=cfg.attention
            )
            out_BTHD = out_BHD[:, None].astype(dt)
            new_cache = cache.replace(kv=tuple(kv))
        else:  # write the new rows at their positions, attend over the whole cache
            new_cache = (
                _write_rows(cache[0], k_BTKD, positions_BT, layer),
                _write_rows(cache[1], v_BTKD, positions_BT, layer),
            )
            keys_BSKD, values_BSKD = new_cache[0][layer], new_cache[1][layer]
            S = keys_BSKD.shape[1]
            key_pos_BS = jnp.broadcast_to(jnp.arange(S, dtype=positions_BT.dtype), (x_BTE.shape[0], S))
            mask_BTS = key_pos_BS[:, None, :] <= positions_BT[:, :, None]
            out_BTHD = reference_attention(q_BTHD, keys_BSKD.astype(dt), values_BSKD.astype(dt), mask_BTS)
        y_BTE = jnp.einsum("bthd,hde->bte", out_BTHD, self.o_HDE[...].astype(dt))
        if cfg.attention_out_bias:
            y_BTE = y_BTE + self.o_bias_E[...].astype(dt)
        return y_BTE, new_cache


def _write_rows(cache_LBSKD, new_BTKD, positions_BT, layer):
    """The cache with each row's T new keys (or values) written at its positions in `layer`. One
    token per row (a decode step) is a scatter of B rows into the cache, updated in place; a
    longer run per row (a prefill) a dynamic-update-slice per row."""
    new_BTKD = new_BTKD.astype(cache_LBSKD.dtype)
    if new_BTKD.shape[1] == 1:
        rows_B = jnp.arange(new_BTKD.shape[0])
        return cache_LBSKD.at[layer, rows_B, positions_BT[:, 0]].set(new_BTKD[:, 0], mode="promise_in_bounds")
    write = jax.vmap(
        lambda c_LSKD, u_TKD, p: jax.lax.dynamic_update_slice(c_LSKD, u_TKD[None], (layer, p, 0, 0)),
        in_axes=(1, 0, 0),
        out_axes=1,
    )
    return write(cache_LBSKD, new_BTKD, positions_BT[:, 0])


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        E, M, pd = cfg.hidden_size, cfg.intermediate_size, cfg.param_dtype
        self.dtype = cfg.dtype
        self.gate_EM = _param(_normal(rngs, (E, M), pd), ("embed", "mlp"))
        self.up_EM = _param(_normal(rngs, (E, M), pd), ("embed", "mlp"))
        self.down_ME = _param(_normal(rngs, (M, E), pd), ("mlp", "embed"))

    def __call__(self, x_BTE):
        dt = self.dtype
        gate_BTM = jax.nn.silu(x_BTE @ self.gate_EM[...].astype(dt))
        hidden_BTM = constrain(gate_BTM * (x_BTE @ self.up_EM[...].astype(dt)), ("batch", "length", "mlp"))
        return hidden_BTM @ self.down_ME[...].astype(dt)


class Block(nnx.Module):
    """Pre-norm attention then a dense SwiGLU or (layer `index` of a MoE config) a sparse MoE."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, index: int = 0):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
        self.attn = Attention(cfg, rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
        self.mlp = MoE(cfg, rngs) if cfg.is_moe_layer(index) else MLP(cfg, rngs)

    def __call__(self, x_BTE, positions_BT, cache: tuple | None = None, layer: int = 0):
        """(x_BTE, cache, Routing or None for a dense layer)."""
        h_BTE, new_cache = self.attn(self.input_norm(x_BTE), positions_BT, cache, layer)
        x_BTE = x_BTE + h_BTE
        routing = None
        if isinstance(self.mlp, MoE):
            h_BTE, routing = self.mlp(self.post_attn_norm(x_BTE))
        else:
            h_BTE = self.mlp(self.post_attn_norm(x_BTE))
        return constrain(x_BTE + h_BTE, _RESIDUAL), new_cache, routing


class Decoder(nnx.Module):
    """The causal LM: embedding, `num_layers` blocks, final norm, (tied or untied) LM head."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.config = cfg
        self.embed_VE = _param(_normal(rngs, (cfg.vocab_size, cfg.hidden_size), cfg.param_dtype), ("vocab", "embed"))
        self.layers = nnx.List([Block(cfg, rngs, i) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head_EV = _param(
                _normal(rngs, (cfg.hidden_size, cfg.vocab_size), cfg.param_dtype), ("embed", "vocab")
            )

    def __call__(
        self,
        input_ids_BT,
        positions_BT=None,
        *,
        cache: KVCache | PagedKVCache | None = None,
        return_kv: bool = False,
        return_routing: bool = False,
        return_hidden: bool = False,
    ):
        """Logits (float32) for every input position.

        Without `cache`: a causal forward over the T tokens (positions default to 0..T-1); with
        `return_kv=True` it also returns a KVCache holding exactly those T rows (a prefill).
        With `cache`: the tokens sit at `positions_BT` (contiguous per row); returns
        (logits_BTV, updated cache).
        `return_routing=True` (full forward without `return_kv` only) returns (logits_BTV, routing)
        with one `Routing` per MoE layer (an empty tuple for a dense model).
        `return_hidden=True` (full forward only) returns the final-normed hidden states x_BTE in
        place of the logits, for `unembed` to project a slice of the vocabulary at a time.
        """
        if return_routing and (cache is not None or return_kv):
            raise ValueError("return_routing=True is for the full forward only (no cache, no return_kv)")
        if return_hidden and (cache is not None or return_kv):
            raise ValueError("return_hidden=True is for the full forward only (no cache, no return_kv)")
        cfg = self.config
        B, T = input_ids_BT.shape
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        x_BTE = constrain(jnp.take(self.embed_VE[...], input_ids_BT, axis=0).astype(cfg.dtype), _RESIDUAL)
        new_k, new_v, routings = [], [], []
        paged_cache = isinstance(cache, PagedKVCache)
        stacked = cache if cache is None or paged_cache else (cache.k_LBSKD, cache.v_LBSKD)
        remat = cache is None and cfg.remat != "none"
        if cache is None and cfg.scan_layers:
            x_BTE, kv, routings = self._scanned_blocks(x_BTE, positions_BT, return_kv)
            if kv is not None:
                new_k, new_v = kv
        for i, layer in enumerate(() if cache is None and cfg.scan_layers else self.layers):
            if remat:  # the backward pass recomputes what the policy does not keep
                x_BTE, layer_cache, routing = _rematerialised(cfg.remat)(layer, x_BTE, positions_BT)
            else:
                x_BTE, layer_cache, routing = layer(x_BTE, positions_BT, stacked, i)
            if routing is not None:
                routings.append(routing)
            if cache is None:
                new_k.append(layer_cache[0])
                new_v.append(layer_cache[1])
            else:
                stacked = layer_cache
        x_BTE = self.final_norm(x_BTE)
        logits_BTV = x_BTE if return_hidden else self.unembed(x_BTE)
        if return_routing:
            return logits_BTV, tuple(routings)
        if cache is None and not return_kv:
            return logits_BTV
        if cache is not None:
            return logits_BTV, stacked if paged_cache else KVCache(*stacked)
        if cfg.scan_layers:
            return logits_BTV, KVCache(new_k, new_v)
        return logits_BTV, KVCache(jnp.stack(new_k), jnp.stack(new_v))

    def _scanned_blocks(self, x_BTE, positions_BT, return_kv: bool):
        """The full forward's blocks as one `lax.scan` (ModelConfig.scan_layers): the blocks'
        params stacked along a leading layer axis, cast to the compute dtype first (each block casts
        them so before use, so no number changes; the stack holds half the bytes of fp32 masters).
        Returns (x_BTE, (k_LBTKD, v_LBTKD) or None, one Routing per MoE layer)."""
        cfg = self.config
        graphdef, _ = nnx.split(self.layers[0])
        states = [in_compute_dtype(nnx.state(layer), cfg.dtype) for layer in self.layers]
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)

        def body(x_BTE, state):
            x_BTE, (k_BTKD, v_BTKD), routing = nnx.merge(graphdef, state)(x_BTE, positions_BT)
            return x_BTE, ((k_BTKD, v_BTKD) if return_kv else None, routing)

        if cfg.remat != "none":  # the backward pass recomputes what the policy does not keep
            body = jax.checkpoint(body, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=False)
        x_BTE, (kv, routing_L) = jax.lax.scan(body, x_BTE, stacked)
        if routing_L is None:
            return x_BTE, kv, []
        return x_BTE, kv, [jax.tree.map(lambda a, i=i: a[i], routing_L) for i in range(cfg.num_layers)]

    def unembed(self, x_BTE, start=0, size: int | None = None):
        """Logits (float32) of the vocabulary entries [start, start + size) (default: all of them)
        from final hidden states, through the tied embedding or the LM head; `start` may be traced,
        so a scan can walk the vocabulary one slice at a time."""
        cfg = self.config
        if cfg.tie_word_embeddings:
            head_VE = self.embed_VE[...]
            if size is not None:
                head_VE = jax.lax.dynamic_slice_in_dim(head_VE, start, size, axis=0)
            head_EV = head_VE.T
        else:
            head_EV = self.lm_head_EV[...]
            if size is not None:
                head_EV = jax.lax.dynamic_slice_in_dim(head_EV, start, size, axis=1)
        logits_BTV = jnp.einsum("bte,ev->btv", x_BTE, head_EV.astype(cfg.dtype), preferred_element_type=jnp.float32)
        return constrain(logits_BTV, ("batch", "length", "vocab"))


_RESIDUAL = ("batch", "length", "embed")  # the residual stream's layout: rows split, features whole
_REMAT_POLICIES = {
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


def _rematerialised(policy: str):
    """A block's full forward under `jax.checkpoint` with the named policy (ModelConfig.remat)."""
    return nnx.remat(lambda block, x_BTE, positions_BT: block(x_BTE, positions_BT), policy=_REMAT_POLICIES[policy])


def init_model(cfg: ModelConfig, seed: int = 0) -> Decoder:
    """A randomly initialised decoder (std 0.02 normals, unit norms, zero biases)."""
    return Decoder(cfg, nnx.Rngs(params=seed))
