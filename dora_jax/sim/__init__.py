"""Discrete-event simulator: the shipped coordinator's policies on a modelled cluster (no JAX).

The modes, the version window, the orchestrator and the ledger are the coordinator's own
(`dora_jax.core.modes`, `dora_jax.coordinator`); the simulator models time and cost only.
"""

from dora_jax.core.modes import Mode
from dora_jax.sim.cluster import ClusterSpec, DecodeModel, Placement, fit_decode, make_cluster
from dora_jax.sim.simulate import ModeResult, simulate
from dora_jax.sim.workload import WorkloadSpec

__all__ = [
    "ClusterSpec",
    "DecodeModel",
    "Mode",
    "ModeResult",
    "Placement",
    "WorkloadSpec",
    "fit_decode",
    "make_cluster",
    "simulate",
]
