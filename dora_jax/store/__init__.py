"""Multi-version parameter store: `ParamStore` over an in-process or a tensorstore `Tier`."""

from dora_jax.store.in_process import InProcessTier
from dora_jax.store.param_store import ParamStore, StoreError, Tier
from dora_jax.store.tensorstore_tier import TensorStoreTier, version_dir_name

__all__ = ["InProcessTier", "ParamStore", "StoreError", "TensorStoreTier", "Tier", "version_dir_name"]
