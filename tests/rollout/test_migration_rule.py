"""How a migrated request moves (dora_jax.rollout.migration): its KV rows on host, device to device,
through a transfer server between slices, or re-prefilled at the destination, each continuing
exactly as the request would have without moving; the rule picks the cheaper way from measured
prefill times and link rates."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dora_jax.core.records import KVTicket, Reprefill, Request, SamplingParams, SlotState
from dora_jax.rollout import migration
from dora_jax.rollout.migration import MigrationCosts
from dora_jax.rollout.worker import RolloutWorker, export_from, import_into
from dora_jax.runtime import run_config
from dora_jax.transport import codec
from dora_jax.transport.kv_transfer import KVTransfer
from tests.rollout.conftest import PAGED, run_to_end

REQUESTS = [
    Request(f"r{i}", "g", f"p{i}", tuple(range(3 + i, 10 + 4 * i)), 0, 24, SamplingParams(temperature=1.0, seed=40 + i))
    for i in range(3)
]


def test_rule_takes_the_cheaper_way():
    costs = MigrationCosts(link_bytes_per_s=1e9, link_latency_s=1e-3, prefill_seconds={16: 0.002, 32: 0.003})
    assert costs.kv_s(4_000_000) == pytest.approx(0.005)
    assert costs.reprefill_s([32, 16]) == pytest.approx(0.005)
    assert costs.choose(4_000_000, [32]) == migration.REPREFILL  # 3 ms of prefill < 5 ms on the link
    assert costs.choose(1_000_000, [32]) == migration.KV  # 2 ms on the link < 3 ms
    assert costs.choose(4_000_000, [64]) == migration.KV  # an unmeasured bucket: cannot show re-prefill is cheaper
    assert MigrationCosts(prefill_seconds={32: 0.0}).choose(10**9, [32]) == migration.KV  # link rate unknown
    assert MigrationCosts(policy="reprefill").choose(1, [64]) == migration.REPREFILL
    assert MigrationCosts(policy="kv", link_bytes_per_s=1.0, prefill_seconds={32: 0.0}).choose(9, [32]) == "kv"


def test_link_latency_and_rate_are_fitted_to_measured_moves():
    costs = MigrationCosts(link_bytes_per_s=5e9)  # the config's figure, until a move is measured
    costs.observe_link(1_000, 1.1)
    assert costs.link_bytes_per_s == pytest.approx(1_000 / 1.1) and costs.link_latency_s == 0  # one size
    costs.observe_link(3_000, 3.1)  # 0.1 s of latency + 1,000 bytes/s
    assert costs.link_bytes_per_s == pytest.approx(1_000) and costs.link_latency_s == pytest.approx(0.1)
    assert costs.kv_s(10_000) == pytest.approx(10.1)
    costs.observe_link(0, 1.0)  # nothing moved: no measurement
    assert len(costs.moves) == 2
    for _ in range(40):  # the last 32 moves count: a faster link now
        costs.observe_link(2_000, 0.2)
        costs.observe_link(4_000, 0.3)
    assert costs.link_bytes_per_s == pytest.approx(20_000) and costs.link_latency_s == pytest.approx(0.1)


def test_one_stalled_move_does_not_turn_the_rule_to_re_prefill():
    """The moves a bench_longtail slice measured (bytes, seconds), one of them stalled 0.81 s while
    its source restored a version: least squares priced a 128 KiB move at 1.3 s against an 8 ms
    re-prefill, so the slice re-prefilled every request from then on (and measured no move again)."""
    measured = [(32768, 0.0037), (16384, 0.0047), (16384, 0.0991), (16384, 0.0192), (32768, 0.8093)]
    measured += [(32768, 0.0013), (32768, 0.0013)]
    costs = MigrationCosts(prefill_seconds={32: 0.0082})
    for num_bytes, seconds in measured:
        costs.observe_link(num_bytes, seconds)
    assert costs.kv_s(131072) < 0.0082 and costs.choose(131072, [32]) == migration.KV
    # moves whose time does not grow with their size are latency-bound: their median time
    assert costs.link_latency_s == pytest.approx(0.0047) and costs.kv_s(10**6) == pytest.approx(0.0047)
    # a link that really is slow still re-prefills
    slow = MigrationCosts(prefill_seconds={32: 0.0082})
    for num_bytes, seconds in measured:
        slow.observe_link(num_bytes, 10 * seconds + num_bytes / 1e6)
    assert slow.choose(131072, [32]) == migration.REPREFILL


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match=r"rollout.migration='fast'"):
        MigrationCosts(policy="fast")
    with pytest.raises(ValueError, match=r"rollout.kv_link_bytes_per_s=-1"):
        MigrationCosts(link_bytes_per_s=-1)
    from configs import smoke

    c = smoke.get_config()
    c.rollout.migration = "sometimes"
    with pytest.raises(ValueError, match="rollout.migration='sometimes'"):
        run_config.parse(c)


def test_the_smallest_prefill_bucket_is_a_config_field():
    from configs import smoke

    c = smoke.get_config()  # page_size 16, max_prefill_length 128
    assert run_config.parse(c).rollout.engine_config().prefill_buckets == (16, 32, 64, 128)
    c.rollout.min_prefill_bucket = 64
    assert run_config.parse(c).rollout.engine_config().prefill_buckets == (64, 128)
    c.rollout.min_prefill_bucket = 512  # past the largest: the largest alone
    assert run_config.parse(c).rollout.engine_config().prefill_buckets == (128,)
    for bad in (48, 8, -16):
        c.rollout.min_prefill_bucket = bad
        with pytest.raises(ValueError, match=rf"rollout.min_prefill_bucket={bad}; expected .* power of two >= "):
            run_config.parse(c)


def test_warmup_measures_every_prefill_bucket(paged_engine):
    assert sorted(paged_engine.prefill_seconds) == list(PAGED.prefill_buckets)
    assert all(s > 0 for s in paged_engine.prefill_seconds.values())


def _midway(engine, params, costs: MigrationCosts):
    """A worker that ran every request to the end (the reference) and then 7 steps into them again."""
    source = RolloutWorker(engine, slice_id=0, eos_ids=(), migration=costs)
    source.load_version(0, params)
    for request in REQUESTS:
        source.submit(request)
    reference = run_to_end(source)
    for request in REQUESTS:
        source.submit(request)
    for _ in range(7):
        assert not source.step()
    return source, reference


def _continue(engine, params, items) -> dict:
    destination = RolloutWorker(engine, slice_id=1, eos_ids=())
    destination.load_version(0, params)
    import_into(destination, items[::-1])
    return run_to_end(destination), destination


def _assert_same(migrated: dict, reference: dict, *, exact: bool):
    assert sorted(migrated) == sorted(reference)
    for traj_id, ref in reference.items():
        moved = migrated[traj_id]
        assert moved.response_ids == ref.response_ids, traj_id
        if exact:
            assert moved.logprobs == ref.logprobs, traj_id
        else:  # the prefix's keys from a prefill, not from the decode steps: rounding differs
            np.testing.assert_allclose(moved.logprobs, ref.logprobs, atol=1e-5, rtol=0)
        assert moved.versions_seen == (0,) and moved.slice_id == 1


@pytest.mark.parametrize("link", ["slow", "fast"])
def test_auto_rule_on_measured_prefill(paged_engine, paged_engine_b, tiny_params, link):
    """The engine's measured prefill times against a link of 1 byte/s (re-prefill) or 1 PB/s (KV)."""
    costs = MigrationCosts(link_bytes_per_s=1.0 if link == "slow" else 1e15)
    source, reference = _midway(paged_engine, tiny_params, costs)
    items = export_from(source, [r.traj_id for r in REQUESTS], to_host=False)
    kind = Reprefill if link == "slow" else SlotState
    assert [type(i) for i in items] == [kind] * len(REQUESTS)
    migrated, destination = _continue(paged_engine_b, tiny_params, items)
    if link == "slow":
        assert destination.counters.prefills == len(REQUESTS) and destination.counters.imports == 0
        for item in items:  # its tokens so far come along as the prefix to re-prefill
            assert len(item.request.prefix_response_ids) == len(item.request.prefix_logprobs) >= 6
    else:
        assert destination.counters.prefills == 0 and destination.counters.imports == len(REQUESTS)
    _assert_same(migrated, reference, exact=link == "fast")
    assert paged_engine.pages.free_pages == paged_engine.pages.capacity_pages


def test_device_to_device_rows_are_bucketed_and_measure_the_link(paged_engine, paged_engine_b, tiny_params):
    source, reference = _midway(paged_engine, tiny_params, MigrationCosts(policy="kv"))
    states = export_from(source, [r.traj_id for r in REQUESTS], to_host=False)
    for state in states:
        assert state.k_LSKD.shape[1] == PAGED.rows_bucket(state.position) >= state.position
        assert set(state.k_LSKD.devices()) == set(paged_engine.mesh.devices.flat)
    destination = RolloutWorker(paged_engine_b, slice_id=1, eos_ids=())
    destination.load_version(0, tiny_params)
    import_into(destination, states)
    assert destination.migration.link_bytes_per_s > 0  # the copies were timed
    _assert_same(run_to_end(destination), reference, exact=True)


def test_kv_rows_pulled_through_transfer_servers(paged_engine, paged_engine_b, tiny_params):
    """The source offers the rows on its transfer server; the message the coordinator carries holds
    only their shapes and a ticket (its arrays: the RNG keys alone); the destination pulls the rows
    over a real connection onto its devices and continues bit-exactly."""
    source, reference = _midway(paged_engine, tiny_params, MigrationCosts(policy="kv"))
    sender, receiver = KVTransfer(paged_engine, host="127.0.0.1"), KVTransfer(paged_engine_b, host="127.0.0.1")
    offered = [sender.offer(s) for s in export_from(source, [r.traj_id for r in REQUESTS], to_host=False)]
    messages, arrays = codec.migratables_to_proto(offered)
    assert [a.shape for a in arrays] == [(2,)] * len(REQUESTS)  # no KV bytes through the coordinator
    carried = codec.migratables_from_proto(messages, iter(arrays))
    assert all(s.kv_ticket.address == sender.address for s in carried)
    costs = MigrationCosts()
    pulled = receiver.resolve(carried, costs)
    assert receiver.failures == 0 and receiver.pulled_bytes == sum(s.num_bytes for s in offered)
    assert costs.link_bytes_per_s > 0
    for state in pulled:
        assert state.kv_ticket is None and set(state.k_LSKD.devices()) == set(paged_engine_b.mesh.devices.flat)
    migrated, destination = _continue(paged_engine_b, tiny_params, pulled)
    assert destination.counters.prefills == 0
    _assert_same(migrated, reference, exact=True)


def test_failed_pull_falls_back_to_reprefill(paged_engine, paged_engine_b, tiny_params):
    """A ticket nobody offers (the source died, or the offer expired): the destination re-prefills
    the request from the tokens the message carries; nothing sampled is lost, nothing changes."""
    source, reference = _midway(paged_engine, tiny_params, MigrationCosts(policy="kv"))
    states = export_from(source, [r.traj_id for r in REQUESTS], to_host=False)
    sender = KVTransfer(paged_engine, host="127.0.0.1")
    receiver = KVTransfer(paged_engine_b, host="127.0.0.1", pull_timeout_s=1.0)
    bogus = [dataclasses.replace(s, kv_ticket=KVTicket(sender.address, 7)) for s in states]
    logged = []
    resolved = receiver.resolve(bogus, None, logged.append)
    assert receiver.failures == len(REQUESTS) and len(logged) == len(REQUESTS)
    assert all(isinstance(i, Reprefill) for i in resolved)
    migrated, destination = _continue(paged_engine_b, tiny_params, resolved)
    assert destination.counters.prefills == len(REQUESTS)
    _assert_same(migrated, reference, exact=False)


def test_bfloat16_rows_cross_the_wire_and_the_transfer_servers(paged_engine, paged_engine_b):
    """The served dtype of the TPU configs: numpy knows bfloat16 only as raw bytes ('<V2'), so the
    wire names it; rows through the frames and through a pull come back bit for bit."""
    import jax
    import jax.numpy as jnp

    prefix = paged_engine.get_prefix_destination_sharding()
    shape = (2, 16, 2, 16)  # TINY's layers, a 16-row bucket, kv heads, head_dim
    k = jax.device_put(jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape).astype(jnp.bfloat16), prefix.k_LRKD)
    v = jax.device_put(-k, prefix.v_LRKD)
    state = SlotState(REQUESTS[0], k, v, 15, 1, (1,), (-0.5,), (0,), np.zeros(2, np.uint32), 0)

    messages, arrays = codec.migratables_to_proto(
        [dataclasses.replace(state, k_LSKD=np.asarray(k), v_LSKD=np.asarray(v))]
    )
    assert messages[0].slot_state.k.dtype == "bfloat16"
    (inline,) = codec.migratables_from_proto(messages, iter(arrays))
    assert inline.k_LSKD.dtype == jnp.bfloat16 and np.array_equal(inline.k_LSKD, np.asarray(k))

    sender, receiver = KVTransfer(paged_engine, host="127.0.0.1"), KVTransfer(paged_engine_b, host="127.0.0.1")
    messages, arrays = codec.migratables_to_proto([sender.offer(state)])
    (carried,) = codec.migratables_from_proto(messages, iter(arrays))
    assert carried.k_LSKD.dtype == jnp.bfloat16
    (pulled,) = receiver.resolve([carried])
    assert receiver.failures == 0 and pulled.k_LSKD.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(pulled.k_LSKD), np.asarray(k)) and np.array_equal(
        np.asarray(pulled.v_LSKD), -np.asarray(k)
    )


def test_export_without_kv_releases_the_requests_unread(paged_engine, paged_engine_b, tiny_params):
    """A partial rollout's interrupt re-prefills every request anyway: `kv=False` releases them as
    Reprefills without reading a row, and they continue as they would have."""
    source, reference = _midway(paged_engine, tiny_params, MigrationCosts(policy="kv"))
    exports = source.counters.exports
    items = export_from(source, [r.traj_id for r in REQUESTS], kv=False)
    assert all(isinstance(i, Reprefill) for i in items) and source.num_active == 0
    assert source.counters.exports == exports + len(REQUESTS)
    migrated, destination = _continue(paged_engine_b, tiny_params, items)
    assert destination.counters.prefills == len(REQUESTS)
    _assert_same(migrated, reference, exact=False)


def test_a_slot_whose_rows_were_not_pulled_is_refused_by_name(paged_engine, paged_engine_b, tiny_params):
    source, _ = _midway(paged_engine, tiny_params, MigrationCosts(policy="kv"))
    (state,) = export_from(source, [REQUESTS[0].traj_id], to_host=False)
    destination = RolloutWorker(paged_engine_b, slice_id=1, eos_ids=())
    destination.load_version(0, tiny_params)
    ticketed = dataclasses.replace(state, kv_ticket=KVTicket("10.0.0.9:1234", 5))
    with pytest.raises(ValueError, match=r"still has its KV rows at 10.0.0.9:1234"):
        destination.import_requests([ticketed])
    for request in REQUESTS[1:]:  # leave the source empty for the next test
        source.release_requests([request.traj_id])
