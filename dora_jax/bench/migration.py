"""`bench engine`'s migration figures: what moving one in-flight request between two rollout
slices costs, by its KV rows or by re-prefill, at several prefix lengths, and what the migration
rule (dora_jax.rollout.migration) decides with the costs it measured.

Two slices of the engine under test on disjoint devices, one request in flight on each side.
Per prefix length (tokens held by the slot), medians over `repeats` moves:
- `kv_transfer_s`: export with the rows left on the devices, offer on the source's transfer
  server, pull onto the destination over a real connection, import (the path between slice
  processes, dora_jax.transport.kv_transfer); `kv_pull_s`: the pull alone;
- `kv_host_s`: export to host, through the wire format (codec frames, written and read back),
  import: the rows' path through the coordinator, less its two gRPC hops;
- `reprefill_s`: prefill of prompt + tokens so far on the destination, in the chunks a
  re-dispatched request takes (either way the slot then takes an insert);
- `cheaper_measured`: the pull against the re-prefill, what the rule weighs;
- `rule`: the destination's choice for that request after the KV moves it timed (its link rate)
  and the prefill times its warmup measured.
The request moves back and forth (source to destination, then back), so both slices stay warm.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from dora_jax.core.records import Request, SamplingParams, SlotState
from dora_jax.rollout import migration
from dora_jax.rollout.migration import MigrationCosts
from dora_jax.rollout.worker import RolloutWorker, export_from, import_into
from dora_jax.transport import codec, kv_transfer

_NEW_TOKENS = 8  # the moved request's budget: it never decodes here, but must fit the cache


def _lengths(engine) -> list[int]:
    """Prompt lengths to measure: up to the longest a re-dispatched request can re-prefill."""
    cfg = engine.config
    longest = min(2 * cfg.max_prefill_length - 1, cfg.cache_length - _NEW_TOKENS - 1)
    return sorted(
        n
        for n in {cfg.max_prefill_length // 4, cfg.max_prefill_length, longest}
        if 1 < n <= longest and _prefillable(cfg, n) and _prefillable(cfg, n + 2)  # the prompt; its re-prefill
    )


def _prefillable(cfg, tokens: int) -> bool:
    try:
        cfg.prefill_chunks(tokens)
    except ValueError:
        return False
    return True


def _wire(state: SlotState) -> SlotState:
    """`state` written to the coordinator's frames and read back."""
    messages, arrays = codec.migratables_to_proto([state])
    copies = [np.frombuffer(a.tobytes(), a.dtype).reshape(a.shape) for a in arrays]
    (back,) = codec.migratables_from_proto(messages, iter(copies))
    return back


def _move(workers, transfers, rule: MigrationCosts, where: int, traj_id: str, how: str) -> int:
    """Moves `traj_id` from workers[where] to the other one, waits for its import; returns where it is."""
    src, dst = workers[where], workers[1 - where]
    if how == "kv_transfer_s":
        (state,) = export_from(src, [traj_id], to_host=False)
        offered = _wire(transfers[where].offer(state))  # the ticket, through the frames
        items = transfers[1 - where].resolve([offered], rule)
        if not isinstance(items[0], SlotState):
            raise RuntimeError(f"the KV pull of {traj_id} failed (see the log above): nothing to time")
    else:
        items = [_wire(s) for s in export_from(src, [traj_id])]
    import_into(dst, items)
    dst.block_until_ready()
    return 1 - where


def measure_migration(engines, params, *, repeats: int = 5, vocab_size: int) -> list[dict]:
    """Rows per prefix length; `engines`: two warm engines of one shape on disjoint devices (each
    loads its own copy of `params`)."""
    workers = [
        RolloutWorker(e, slice_id=i, eos_ids=(), pipelined=False, migration=MigrationCosts(policy=migration.KV))
        for i, e in enumerate(engines)
    ]
    loaded = [e.load_params(params) for e in engines]
    for worker, p in zip(workers, loaded):
        worker.load_version(0, p)
    transfers = [kv_transfer.KVTransfer(e, host="127.0.0.1") for e in engines]
    rule = MigrationCosts()  # the destination's own rule: the measured prefill times and link rate
    rule.prefill_seconds = engines[1].prefill_seconds
    rng = np.random.default_rng(0)
    rows = []
    for tokens in _lengths(engines[0]):
        prompt = tuple(int(t) for t in rng.integers(3, vocab_size, tokens))
        request = Request(f"mig{tokens}", "bench", "bench", prompt, 0, _NEW_TOKENS, SamplingParams(seed=tokens))
        workers[0].submit(request)
        workers[0].step()  # prefill: `tokens` rows held, the first token pending
        if request.traj_id not in workers[0].active_traj_ids:
            raise RuntimeError(f"the {tokens}-token request was not admitted")
        where, times = 0, {"kv_transfer_s": [], "kv_pull_s": [], "kv_host_s": [], "reprefill_s": []}
        for _ in range(repeats):
            for how in ("kv_transfer_s", "kv_host_s"):
                start, pulled = time.perf_counter(), transfers[1 - where].pull_s
                where = _move(workers, transfers, rule, where, request.traj_id, how)
                times[how].append(time.perf_counter() - start)
                if how == "kv_transfer_s":
                    times["kv_pull_s"].append(transfers[where].pull_s - pulled)
        state = workers[where].progress()[request.traj_id]
        ids = np.asarray(state.prompt_ids + state.prefix_response_ids, np.int32)
        for _ in range(repeats):
            start = time.perf_counter()
            _reprefill(engines[1], loaded[1], ids)
            times["reprefill_s"].append(time.perf_counter() - start)
        workers[where].export_requests([request.traj_id])  # done with it
        medians = {how: float(np.median(t)) for how, t in times.items()}
        cfg, model = engines[1].config, engines[1].model_config
        position = len(ids) - 1
        row_bytes = 2 * model.num_layers * model.num_kv_heads * model.head_dim * np.dtype(model.dtype).itemsize
        buckets = [next(b for b in cfg.prefill_buckets if b >= n) for n in cfg.prefill_chunks(len(ids))]
        moved = cfg.rows_bucket(position) * row_bytes
        rows.append(
            {
                "prefix_tokens": position,
                "kv_bytes": position * row_bytes,
                "kv_bytes_moved": moved,  # padded to the rows bucket, device to device
                **medians,
                "measured_link_bytes_per_s": rule.link_bytes_per_s,
                "measured_link_latency_s": rule.link_latency_s,
                "rule_reprefill_estimate_s": rule.reprefill_s(buckets),
                "rule": rule.choose(moved, buckets),
                # What the rule weighs, measured: the pull against the prefills (both then insert).
                "cheaper_measured": "kv" if medians["kv_pull_s"] <= medians["reprefill_s"] else "reprefill",
            }
        )
    return rows


def _reprefill(engine, params, ids: np.ndarray) -> None:
    """What re-dispatching a request costs the destination beyond a KV import: its chunks'
    prefills (either way the slot then takes an insert)."""
    prefix, begin = None, 0
    for chunk in engine.config.prefill_chunks(len(ids)):
        begin += chunk
        prefix, _ = engine.prefill(
            params=params,
            existing_prefix=prefix,
            padded_tokens=ids[begin - chunk : begin],
            true_length=chunk,
            sample_first=begin < len(ids),
        )
    jax.block_until_ready(prefix)
