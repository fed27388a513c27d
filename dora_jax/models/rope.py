"""Rotary position embeddings, plain and with the Llama 3.1 frequency-scaling rule.

Shape letters: B batch, T time, H heads, D head_dim, F D/2 frequencies.
The rotation is HF's "rotate half" layout (first half / second half of D), which is how HF
Llama and Qwen checkpoints store q/k projections.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from dora_jax.models.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Per-pair inverse frequencies `inv_freq_F`, with the `llama3` rule applied when asked.

    llama3: wavelengths longer than original_ctx / low_freq_factor are divided by `factor`,
    those shorter than original_ctx / high_freq_factor are kept, and the band in between is a
    linear blend in (original_ctx / wavelength).
    """
    inv_freq_F = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if rope.kind == "default":
        return inv_freq_F.astype(np.float32)
    old_ctx = rope.original_max_position_embeddings
    low_wavelen = old_ctx / rope.low_freq_factor
    high_wavelen = old_ctx / rope.high_freq_factor
    wavelen_F = 2 * math.pi / inv_freq_F
    scaled_F = np.where(wavelen_F > low_wavelen, inv_freq_F / rope.factor, inv_freq_F)
    smooth_F = (old_ctx / wavelen_F - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended_F = (1 - smooth_F) * scaled_F / rope.factor + smooth_F * scaled_F
    medium_F = (wavelen_F >= high_wavelen) & (wavelen_F <= low_wavelen)
    return np.where(medium_F, blended_F, scaled_F).astype(np.float32)


def apply_rope(x_BTHD: jnp.ndarray, positions_BT: jnp.ndarray, inv_freq_F: np.ndarray) -> jnp.ndarray:
    """Rotates q or k by their positions (fp32 maths, result in x's dtype)."""
    angles_BTF = positions_BT[..., None].astype(jnp.float32) * jnp.asarray(inv_freq_F)
    cos_BT1D = jnp.concatenate([jnp.cos(angles_BTF)] * 2, axis=-1)[:, :, None, :]
    sin_BT1D = jnp.concatenate([jnp.sin(angles_BTF)] * 2, axis=-1)[:, :, None, :]
    x = x_BTHD.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos_BT1D + rotated * sin_BT1D).astype(x_BTHD.dtype)
