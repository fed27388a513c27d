"""Migration: a request exported mid-generation from one slice's engine and imported into another
slice's engine (other devices, same params) continues bit-exactly with zero prefills."""

from __future__ import annotations

import numpy as np
import pytest

from dora_jax.core.records import Request, SamplingParams
from dora_jax.rollout.worker import RolloutWorker
from tests.rollout.conftest import TINY, run_to_end

SAMPLINGS = [
    SamplingParams(temperature=1.0, seed=11),
    SamplingParams(temperature=1.0, top_p=0.9, seed=12),
    SamplingParams(temperature=0.8, top_k=10, seed=13),
    SamplingParams(temperature=0.0),
]


def _requests():
    return [
        Request(f"m{i}", "g", f"p{i}", tuple(range(1 + i, 6 + 3 * i)), 0, 20 + 3 * i, s)
        for i, s in enumerate(SAMPLINGS)
    ]


LAYOUTS = {  # (source, destination) engines: dense caches, paged caches, paged to dense
    "dense": ("warm_engine", "engine_b"),
    "paged": ("paged_engine", "paged_engine_b"),
    "paged_to_dense": ("paged_engine", "engine_b"),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("pipelined", [True, False])
def test_migrated_equals_never_migrated(request, tiny_params, slices, pipelined, layout):
    """Pipelined, the source exports with a decode step in flight: the records hold 7 tokens, the
    device 8; the 8th is dropped there and recomputed (identically) at the destination. Paged, an
    export reads only the slot's pages and an import takes only the pages it needs."""
    warm_engine, engine_b = (request.getfixturevalue(name) for name in LAYOUTS[layout])
    assert set(warm_engine.mesh.devices.flat).isdisjoint(engine_b.mesh.devices.flat)
    source = RolloutWorker(warm_engine, slice_id=0, eos_ids=(), pipelined=pipelined)
    source.load_version(0, tiny_params)
    for request in _requests():
        source.submit(request)
    reference = run_to_end(source)

    for request in _requests():
        source.submit(request)
    for _ in range(7):
        assert not source.step()  # mid-generation: nobody has finished yet
    states = source.export_requests()
    assert source.num_active == 0 and len(states) == len(SAMPLINGS)
    for state in states:
        assert state.k_LSKD.shape == (TINY.num_layers, state.position, TINY.num_kv_heads, TINY.head_dim)
        assert state.position == len(state.request.prompt_ids) + len(state.response_ids) - 1
        held = 8 - pipelined  # the first token + one per step read
        assert state.last_token == state.response_ids[-1] and state.token_versions == (0,) * held
        assert state.version == 0 and state.rng_key.dtype == np.uint32 and state.num_bytes > 0

    destination = RolloutWorker(engine_b, slice_id=1, eos_ids=(), pipelined=pipelined)
    destination.load_version(0, tiny_params)
    destination.import_requests(states[::-1])  # land in other slots than they left
    migrated = run_to_end(destination)

    assert destination.counters.prefills == 0 and destination.counters.imports == len(states)
    for traj_id, ref in reference.items():
        moved = migrated[traj_id]
        assert moved.response_ids == ref.response_ids, traj_id
        if layout == "paged_to_dense":  # tokens after the move come from the other cache's attention
            np.testing.assert_allclose(moved.logprobs, ref.logprobs, atol=1e-5, rtol=0)
        else:
            assert moved.logprobs == ref.logprobs, traj_id  # bit-exact, not approximately
        assert moved.versions_seen == (0,) and moved.num_migrations == 1 and moved.slice_id == 1
    for engine in (warm_engine, engine_b):  # every page back in the pool
        assert engine.pages is None or engine.pages.free_pages == engine.pages.capacity_pages


def test_import_refuses_other_versions_and_full_workers(warm_engine, tiny_params):
    source = RolloutWorker(warm_engine, eos_ids=())
    source.load_version(0, tiny_params)
    for request in _requests():
        source.submit(request)
    source.step()
    states = source.export_requests([r.traj_id for r in _requests()[:2]])
    assert source.active_traj_ids == ("m2", "m3")
    other = RolloutWorker(warm_engine, eos_ids=())
    other.load_version(5, tiny_params)
    try:
        other.import_requests(states)
    except ValueError as err:
        assert "version 0" in str(err) and "version 5" in str(err)
    else:
        raise AssertionError("import across versions must be refused")
    source.import_requests(states)
    assert source.num_free_slots == 0
    try:
        source.import_requests(states)
    except ValueError as err:
        assert "free slots" in str(err)
    else:
        raise AssertionError("import into a full worker must be refused")
