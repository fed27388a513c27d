"""Discrete-event simulator of DORA and its baselines on a modelled cluster (pure Python + numpy)."""

from dora_jax.sim.cluster import ClusterSpec, DecodeModel, Placement, fit_decode, make_cluster
from dora_jax.sim.simulate import Mode, ModeResult, simulate
from dora_jax.sim.workload import WorkloadSpec

__all__ = [
    "ClusterSpec", "DecodeModel", "Mode", "ModeResult", "Placement", "WorkloadSpec",
    "fit_decode", "make_cluster", "simulate",
]
