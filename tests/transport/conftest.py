"""Tiny engines on two disjoint device slices, and a coordinator service on a real local port."""

from __future__ import annotations

import dataclasses
import threading

import jax.numpy as jnp
import pytest

from dora_jax.models import init_model, split
from dora_jax.parallel import sharding
from dora_jax.rollout.engine import RolloutEngine
from tests.rollout.conftest import ENGINE, TINY


class Sink:
    """Stands where the Coordinator does behind the service (the service's Backend): records
    what arrives. The gRPC path in front of it is real."""

    def __init__(self):
        self.finished, self.failed, self.joined, self.wont_rejoin = {}, [], [], []
        self.lock = threading.Lock()

    def post_finished(self, slice_id, trajectories):
        with self.lock:
            for t in trajectories:
                self.finished[t.traj_id] = (slice_id, t)

    def post_slice_failed(self, slice_id, reason):
        self.failed.append((slice_id, reason))

    def post_slice_joined(self, port):
        self.joined.append(port.slice_id)

    def post_slice_wont_rejoin(self, slice_id, reason):
        self.wont_rejoin.append((slice_id, reason))


@pytest.fixture(scope="session")
def tiny_params():
    return split(init_model(TINY, seed=3))[1]


@pytest.fixture(scope="session")
def two_engines(tiny_params):
    slices = sharding.split_devices({"data": 1}, {"tensor": 2}, 2)
    engines = [RolloutEngine(TINY, ENGINE, mesh) for mesh in slices.rollout]
    for engine in engines:
        engine.warmup(engine.load_params(tiny_params))
    return engines


@pytest.fixture(scope="session")
def two_bf16_engines(tiny_params):
    """The same two engines computing (and caching KV) in bfloat16, as every real config serves."""
    slices = sharding.split_devices({"data": 1}, {"tensor": 2}, 2)
    config = dataclasses.replace(TINY, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    engines = [RolloutEngine(config, ENGINE, mesh) for mesh in slices.rollout]
    for engine in engines:
        engine.warmup(engine.load_params(tiny_params))
    return engines
