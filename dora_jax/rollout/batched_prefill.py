"""Batched prefill (`RolloutEngine.prefill_insert`): the requests, how they are grouped into
programs, and each program's host arguments.

Several requests' prompts go through one forward, each right-padded to the batch's bucket (causal
attention: padding changes nothing before it; a padding row's writes are dropped), their first
tokens sampled with their own keys and positions, and their KV rows written into their slots
(paged: every page of the batch in one scatter) in the same program. A request's tokens and
log-probs are those of `prefill` + `insert`: only the batch's shapes differ (C letters the rows,
T the bucket, Q a row's pages).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dora_jax.core.records import SamplingParams
from dora_jax.rollout.engine_config import EngineConfig
from dora_jax.rollout.slot_pages import SlotPages


@dataclasses.dataclass(frozen=True)
class PrefillRequest:
    """One request of a batched prefill (`RolloutEngine.prefill_insert`): `tokens` (one chunk, at
    most max_prefill_length) prefilled into `slot`; the other fields as `prefill`'s and `insert`'s."""

    slot: int
    tokens: Sequence[int]  # prompt ids (+ a response prefix when re-prefilled)
    sampling: SamplingParams | None = None  # None: EngineConfig.default_sampling
    rng: Any = None  # the request's base key (typed key or uint32[2]); None: from sampling.seed
    sample_first: bool = True  # False: the last token stays pending (resuming a response)
    shared_from: int | None = None  # paged: take this slot's whole pages below the prompt's end


def power_of_two(n: int) -> int:
    """The smallest power of two >= n."""
    return 1 << (n - 1).bit_length()


def batch_plan(config: EngineConfig, lengths: Sequence[int]) -> list[tuple[int, int, list[int]]]:
    """Programs for prompts of `lengths`: (count C, bucket T, indices), the shortest first, each
    the most prompts a batched program takes (count 1: a bucket no batched program takes)."""
    programs = set(config.prefill_batches)
    plan, group = [], []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        grown = group + [i]
        bucket = config.prefill_bucket(max(lengths[j] for j in grown))
        if len(grown) == 1 or (power_of_two(len(grown)), bucket) in programs:
            group = grown
            continue
        plan.append(group)
        group = [i]
    plan.append(group)
    out = []
    for members in plan:
        bucket = config.prefill_bucket(max(lengths[j] for j in members))
        count = power_of_two(len(members)) if (2, bucket) in programs else 1
        out.append((count, bucket, members))
    return out


def batch_arrays(
    config: EngineConfig,
    members: Sequence[tuple[PrefillRequest, Any, int]],
    count: int,
    bucket: int,
    pages: SlotPages | None,
) -> tuple[np.ndarray, ...]:
    """The host arguments of one batched program over `members` [(request, (tokens, sampling, key
    data), shared pages)], padded to `count` rows of `bucket` tokens (a padding row's slot is
    num_slots: its writes are dropped); paged, each row's pages (`pages` has claimed them) last."""
    tokens_CT = np.zeros((count, bucket), np.int32)
    length_C = np.ones((count,), np.int32)
    slot_C = np.full((count,), config.num_slots, np.int32)  # past the slots: dropped
    key_data_C2 = np.zeros((count, 2), np.uint32)
    temperature_C, top_p_C = np.zeros((count,), np.float32), np.ones((count,), np.float32)
    top_k_C, sample_first_C = np.zeros((count,), np.int32), np.zeros((count,), bool)
    pages_CQ = None if pages is None else np.zeros((count, bucket // config.page_size), np.int32)
    for c, (request, (tokens, sampling_params, key_data), shared) in enumerate(members):
        tokens_CT[c, : len(tokens)] = tokens
        length_C[c], slot_C[c], key_data_C2[c] = len(tokens), request.slot, key_data
        temperature_C[c], top_p_C[c] = sampling_params.temperature, sampling_params.top_p
        top_k_C[c], sample_first_C[c] = sampling_params.top_k, request.sample_first
        if pages_CQ is not None:
            pages_CQ[c] = pages.write_row(request.slot, bucket, shared)
    vectors = (tokens_CT, length_C, slot_C, key_data_C2, temperature_C, top_p_C, top_k_C, sample_first_C)
    return vectors if pages_CQ is None else vectors + (pages_CQ,)


def batch_shapes(config: EngineConfig, count: int, bucket: int) -> list[jax.ShapeDtypeStruct]:
    """The host arguments of a batched prefill of `count` rows of `bucket` tokens, as shapes."""
    i32, C = jnp.int32, count
    shapes = [((C, bucket), i32), ((C,), i32), ((C,), i32), ((C, 2), jnp.uint32)]
    shapes += [((C,), jnp.float32), ((C,), jnp.float32), ((C,), i32), ((C,), jnp.bool_)]
    if config.paged:
        shapes.append(((C, bucket // config.page_size), i32))
    return [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
