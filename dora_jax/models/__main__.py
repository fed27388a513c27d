"""`python -m dora_jax.models [--hf_path=DIR]`: builds (or loads) a model and runs one jitted
forward pass, printing the config, the logits shape and the step time. A quick install check."""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from dora_jax.models import ModelConfig, init_model, load_hf, split

_HF_PATH = flags.DEFINE_string("hf_path", None, "HF checkpoint directory; default: a tiny random model")
_BATCH = flags.DEFINE_integer("batch", 4, "batch size")
_LENGTH = flags.DEFINE_integer("length", 64, "sequence length")


def main(argv):
    del argv
    model = (
        load_hf(_HF_PATH.value)
        if _HF_PATH.value
        else init_model(
            ModelConfig(
                vocab_size=256,
                hidden_size=128,
                intermediate_size=256,
                num_layers=2,
                num_heads=4,
                num_kv_heads=2,
                head_dim=32,
            )
        )
    )
    graphdef, params = split(model)
    cfg = model.config
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (_BATCH.value, _LENGTH.value)), jnp.int32)
    forward = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))
    jax.block_until_ready(forward(params, ids))
    start = time.perf_counter()
    logits = jax.block_until_ready(forward(params, ids))
    print(
        json.dumps(
            {
                "model_type": cfg.model_type,
                "layers": cfg.num_layers,
                "hidden": cfg.hidden_size,
                "devices": [str(d) for d in jax.devices()],
                "logits_shape": list(logits.shape),
                "forward_s": round(time.perf_counter() - start, 5),
                "finite": bool(jnp.isfinite(logits).all()),
            }
        )
    )


if __name__ == "__main__":
    app.run(main)
