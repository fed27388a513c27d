"""dora_jax: DORA multi-version streaming rollout for asynchronous RL post-training, in JAX."""

__version__ = "0.1.0"
