"""Our engine behind the real google-jetstream package: its Driver and its gRPC server, end to end."""

from __future__ import annotations

import dataclasses

import grpc
import portpicker
import pytest
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc  # noqa: E402

from dora_jax.core.records import Request, SamplingParams
from dora_jax.rollout import jetstream_adapter  # the jetstream extra is part of the test install
from dora_jax.rollout.engine import RolloutEngine
from dora_jax.rollout.worker import RolloutWorker
from tests.rollout.conftest import PAGED, TINY, run_to_end

PROMPTS = [(1, 4, 9, 16, 25), (7, 3), (40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56)]
MAX_TOKENS = 9


def test_jax_tree_map_shim_is_in_place():
    import jax

    assert jax.tree_map is jax.tree.map


def test_grpc_round_trip_equals_our_greedy_generation(warm_engine, tiny_params):
    params = warm_engine.load_params(tiny_params)
    worker = RolloutWorker(warm_engine)  # stops at the model's EOS, as JetStream's stop tokens do
    worker.load_version(0, params)
    for i, prompt in enumerate(PROMPTS):
        worker.submit(Request(f"j{i}", "g", "p", prompt, 0, MAX_TOKENS, SamplingParams(temperature=0.0)))
    ours = run_to_end(worker)

    port = portpicker.pick_unused_port()
    server = jetstream_adapter.serve(jetstream_adapter.JetStreamEngine(warm_engine, params), port)
    try:
        with grpc.insecure_channel(f"localhost:{port}") as channel:
            stub = jetstream_pb2_grpc.OrchestratorStub(channel)
            assert stub.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=60).is_live
            for i, prompt in enumerate(PROMPTS):
                request = jetstream_pb2.DecodeRequest(
                    token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=list(prompt)),
                    max_tokens=MAX_TOKENS,
                )
                got = [
                    t
                    for response in stub.Decode(request, timeout=120)
                    for sample in response.stream_content.samples
                    for t in sample.token_ids
                ]
                expected = list(ours[f"j{i}"].response_ids)
                if expected and expected[-1] in TINY.eos_ids:
                    expected = expected[:-1]  # JetStream stops at a stop token without sending it
                assert got == expected, (i, got, expected)
            refused = jetstream_pb2.DecodeRequest(  # token 500 is outside the vocabulary
                token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=[1, 500]), max_tokens=4
            )
            assert [
                t for r in stub.Decode(refused, timeout=120) for s in r.stream_content.samples for t in s.token_ids
            ] == []
    finally:
        server.stop()


def test_a_paged_pool_smaller_than_every_slot_is_refused_by_name(slices):
    small = RolloutEngine(TINY, dataclasses.replace(PAGED, num_pages=13), slices.rollout[0])
    with pytest.raises(ValueError, match=r"engine.num_pages=13 holds fewer pages .* \(33\); JetStream's Driver"):
        jetstream_adapter.JetStreamEngine(small)
    jetstream_adapter.JetStreamEngine(RolloutEngine(TINY, PAGED, slices.rollout[0]))  # every slot full: served
