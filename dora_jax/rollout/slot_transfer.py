"""Moving one decode slot between engines with no prefill (KV migration): the host side of
`RolloutEngine.export_slot` / `import_slot`.

An export joins the slot's device state (KV rows, position, pending token, RNG key) with the
host-side record the caller keeps (the generated tokens, log-probs and per-token versions: the
worker reads every step's tokens anyway), checked against each other, into a `SlotState`; an
import turns a `SlotState` back into a `Prefix` that `insert` puts into a slot. Shape letters as
in `engine_state`; S here is the slot's valid rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dora_jax.core.records import Request, SlotState
from dora_jax.models import ModelConfig
from dora_jax.rollout.engine_config import EngineConfig, check_sampling
from dora_jax.rollout.engine_state import Prefix


def export_rows(config: EngineConfig, request: Request, response_ids: Sequence[int]) -> tuple[int, int]:
    """(rows the record says the slot holds, the rows bucket an export reads). The rows come from
    the host record (the device vector may span other processes); `slot_state` checks the
    device's own position against it."""
    expected = len(request.prompt_ids) + len(response_ids) - 1
    return expected, config.rows_bucket(max(expected, 1))


def slot_state(
    slot: int,
    k,
    v,
    position,
    token,
    key_data,
    *,
    expected: int,
    in_flight: int,
    request: Request,
    response_ids: Sequence[int],
    logprobs: Sequence[float],
    token_versions: Sequence[int],
    version: int,
) -> SlotState:
    """The exported slot: its KV rows `k`, `v` and device vectors (position, pending token, key
    data) joined with the record; ValueError when the device's position or token disagree with
    the record (`expected` rows, `in_flight` steps the device took past it)."""
    position = int(position)
    pending = response_ids[-1] if response_ids else None
    if pending is None or position != expected + in_flight or (not in_flight and int(token) != pending):
        raise ValueError(
            f"slot {slot} holds position {position} / token {int(token)} but the record expects "
            f"position {expected} + {in_flight} in flight / token {pending}"
        )
    return SlotState(
        request=request,
        k_LSKD=k,
        v_LSKD=v,
        position=expected,
        last_token=int(pending),
        response_ids=tuple(int(t) for t in response_ids),
        logprobs=tuple(float(x) for x in logprobs),
        token_versions=tuple(int(x) for x in token_versions),
        rng_key=np.asarray(key_data, np.uint32),
        version=int(version),
    )


def import_prefix(model_config: ModelConfig, config: EngineConfig, state: SlotState) -> Prefix:
    """An exported slot as a Prefix (on host where its rows are numpy, padded to their rows
    bucket), checked against this engine's model and sizes (ValueError naming the numbers)."""
    cfg = model_config
    rows = config.rows_bucket(max(state.position, 1))
    shapes = [(cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim) for n in (state.position, rows)]
    if state.k_LSKD.shape not in shapes or state.v_LSKD.shape != state.k_LSKD.shape:
        raise ValueError(
            f"slot state KV has shapes {state.k_LSKD.shape} / {state.v_LSKD.shape}, expected {shapes[0]} "
            f"(or its rows bucket, {shapes[1]}) for this model"
        )
    if state.position + 1 > config.cache_length:
        raise ValueError(f"slot state position {state.position} does not fit cache_length={config.cache_length}")
    params = state.request.sampling
    problem = check_sampling(params, filters=config.sampling_filters)
    if problem:
        raise ValueError(problem)
    pad = ((0, 0), (0, rows - state.k_LSKD.shape[1]), (0, 0), (0, 0))
    padded = lambda x: x if x.shape[1] == rows else np.pad(np.asarray(x), pad)  # noqa: E731
    return Prefix(
        k_LRKD=padded(state.k_LSKD),
        v_LRKD=padded(state.v_LSKD),
        length=np.int32(state.position),
        token=np.int32(state.last_token),
        logp=np.float32(0.0),
        key_data=np.asarray(state.rng_key, np.uint32),
        temperature=np.float32(params.temperature),
        top_p=np.float32(params.top_p),
        top_k=np.int32(params.top_k),
        generated=np.int32(len(state.response_ids)),
    )
