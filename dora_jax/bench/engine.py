"""`bench engine`: decode step time and tokens/s by slot occupancy, prefill tokens/s per bucket,
and compiles after warm-up, for one rollout engine. Writes DIR/engine.json and prints a table.

Occupancy points: 1 slot, 25%, 50% and 100% of `slots`. The engine decodes a fixed-shape batch,
so its own step costs the same at any occupancy (idle slots are computed too: that is the
"bubble" DORA removes). Whether the hardware is in the flat, memory-bound regime where that waste
matters is a separate question, answered by `batch_step_time_s`: the step of an engine compiled
for exactly that many slots. `flat_ratio` = full batch / one-slot batch; <= 1.5 means a decode
step costs about the same for 1 and for `slots` requests (DESIGN.md, "Regime").

`migration`: moving a request between two slices by KV and by re-prefill (dora_jax/bench/migration.py).

`worker_loop`: seconds per decode step at full occupancy of the bare decode loop and of
`RolloutWorker.step()` pipelined (the default) and not, timed side by side; `worker_overhead` =
pipelined step / bare step (issue target: <= 1.1). `kv`: the dense cache's bytes and capacity.

`workload`: `workload_sequences` prompts of `prompt_length` tokens, `workload_new_tokens` tokens
each (the first from prefill), generated end to end two ways on the same engine, alternating in
one process for `workload_rounds` rounds (medians): `one_at_a_time` (a prefill and an insert per
prompt, then every decode step's tokens read before the next is dispatched: the engine's path
before batched prefill) and `batched` (`prefill_insert`, then each decode step dispatched before
the previous one's tokens are read). Both must sample the same tokens. `speedup` = median over
rounds of one_at_a_time seconds / batched seconds; `prefill_share` = each path's prefill seconds
/ its total. `workload_only` runs this alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from dora_jax.bench.migration import measure_migration
from dora_jax.core.records import Request, SamplingParams
from dora_jax.models import ModelConfig, init_model, moe_fields, split
from dora_jax.parallel import sharding
from dora_jax.rollout.engine import EngineConfig, PrefillRequest, RolloutEngine
from dora_jax.rollout.worker import RolloutWorker


@dataclasses.dataclass(frozen=True)
class EngineBenchConfig:
    """What to measure; defaults are the 2-layer d64 model the trace-driven benchmark runs."""

    num_layers: int = 2
    hidden_size: int = 64
    intermediate_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    vocab_size: int = 256
    num_experts: int = 0  # > 0: a Qwen3-MoE, every layer sparse (as `configs/smoke_moe.py`)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_dispatch: str = "grouped"
    slots: int = 32  # decode slots of the engine under test
    cache_length: int = 256  # rows per slot
    max_prefill_length: int = 128  # largest prefill bucket
    prompt_length: int = 16  # prompt of the requests that fill the slots
    decode_steps: int = 50  # timed generate calls per point
    prefill_repeats: int = 10  # timed prefills per bucket
    loop_blocks: int = 20  # timed blocks of 10 steps per loop in the side-by-side worker timing
    tensor_parallel: int = 1  # devices the engine is sharded over (tensor axis)
    batch_curve: bool = True  # also time engines compiled for each point's slot count
    page_size: int = 0  # paged KV cache: rows per page (0 = the dense cache)
    kv_pages: int = 0  # pages in the pool (0 = every slot full)
    compare_dense: bool = True  # paged: also time a dense engine's worker loop, side by side
    migration: bool = True  # time moving a request between two slices, by KV and by re-prefill
    migration_repeats: int = 5  # timed moves per prefix length and way
    workload_sequences: int = 32  # end-to-end workload: prompts of prompt_length tokens (at most `slots` of them)
    workload_new_tokens: int = 64  # tokens generated per prompt, the first by prefill
    workload_rounds: int = 3  # rounds of the two workload paths, alternating (medians)
    workload_only: bool = False  # time the end-to-end workload alone (nothing else)
    seed: int = 0


def _model_config(config: EngineBenchConfig) -> ModelConfig:
    moe = moe_fields(config)  # a Qwen3-MoE (with Qwen3's q/k norms) when num_experts > 0
    return ModelConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        qk_norm=bool(moe),
        **moe,
    )


def _engine(config: EngineBenchConfig, slots: int, mesh, *, paged: bool = True) -> RolloutEngine:
    """An engine of `slots` slots; paged as `config` says unless `paged=False` (the dense cache).
    Engines of the same sizes share compiled programs; each keeps its own page pool."""
    page_size = config.page_size if paged else 0
    engine_config = EngineConfig(
        num_slots=slots,
        cache_length=config.cache_length,
        max_prefill_length=config.max_prefill_length,
        min_prefill_bucket=min(max(16, page_size), config.max_prefill_length),
        page_size=page_size,
        num_pages=config.kv_pages if page_size and slots == config.slots else 0,
    )
    return RolloutEngine(_model_config(config), engine_config, mesh)


def _time_steps(engine: RolloutEngine, params, state, steps: int) -> tuple[float, object]:
    """Median seconds per generate call, with the token fetch the worker does after each one
    (the median, because other processes share these cores)."""
    for _ in range(2):
        state, result = engine.generate(params, state)
        jax.device_get(result.data)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, result = engine.generate(params, state)
        jax.device_get((result.data, result.log_prob))
        times.append(time.perf_counter() - start)
    return float(np.median(times)), state


def _fill(engine: RolloutEngine, params, state, active: int, prompt_length: int, rng: np.random.Generator):
    for slot in range(active):
        prompt = rng.integers(0, engine.model_config.vocab_size, prompt_length).astype(np.int32)
        prefix, _ = engine.prefill(
            params=params,
            padded_tokens=prompt,
            true_length=prompt_length,
            sampling=SamplingParams(temperature=1.0, seed=slot),
        )
        state = engine.insert(prefix, state, slot)
    return state


def _measure_decode(config: EngineBenchConfig, engine, params, mesh, rng) -> list[dict]:
    points = []
    for active in sorted({1, max(1, config.slots // 4), max(1, config.slots // 2), config.slots}):
        state = _fill(engine, params, engine.init_decode_state(), active, config.prompt_length, rng)
        step, state = _time_steps(engine, params, state, config.decode_steps)
        point = {
            "active_slots": active,
            "occupancy": active / config.slots,
            "step_time_s": step,
            "tokens_per_s": active / step,
        }
        if config.batch_curve:
            sized = engine if active == config.slots else _engine(config, active, mesh)
            sized_params = sized.load_params(params)
            point["batch_step_time_s"], _ = _time_steps(
                sized, sized_params, sized.init_decode_state(), config.decode_steps
            )
        points.append(point)
    return points


def _full_worker(config: EngineBenchConfig, engine, params, *, pipelined: bool) -> RolloutWorker:
    """A worker with every slot busy on a request long enough to outlast the measurement."""
    worker = RolloutWorker(engine, eos_ids=(), pipelined=pipelined)
    worker.load_version(0, params)
    budget = config.cache_length - config.prompt_length
    for slot in range(config.slots):
        prompt = tuple(int(t) for t in np.arange(slot, slot + config.prompt_length) % config.vocab_size)
        worker.submit(Request(f"bench{slot}", "bench", "bench", prompt, 0, budget, SamplingParams(seed=slot)))
    worker.step()  # admission: prefills + the first decode step
    return worker


def _bare_loop(engine: RolloutEngine, params, state) -> Callable[[int], None]:
    """`generate` alone, each step's tokens read after the next step is dispatched: the device never
    waits for the host (the bare decode step)."""
    unread = []

    def run(steps: int) -> None:
        nonlocal state
        for _ in range(steps):
            state, result = engine.generate(params, state)
            result.copy_to_host_async()
            unread.append(result)
            if len(unread) > 1:
                unread.pop(0).convert_to_numpy()
        unread.pop().convert_to_numpy()
        jax.block_until_ready(state)

    return run


def _worker_loop(worker: RolloutWorker) -> Callable[[int], None]:
    def run(steps: int) -> None:
        for _ in range(steps):
            worker.step()
        worker.block_until_ready()  # a pipelined worker's last step is still in flight

    return run


def _measure_worker_loop(config: EngineBenchConfig, mesh, params, rng) -> tuple[dict, RolloutWorker]:
    """Seconds per decode step at full occupancy of the bare loop and of `RolloutWorker.step()`
    pipelined and not (and, for a paged engine, a dense engine's pipelined worker): blocks of steps
    (each ending with a wait for the device, so a block spans exactly its device steps), the loops
    taking turns in rotating order, each on its own engine (one decode state per engine); medians
    of the blocks (other processes share these cores); each ratio is the median over turns of one
    loop's block time over another's. Also returns the pipelined worker."""
    steps = max(1, config.cache_length - config.prompt_length - 2)  # the workers' requests must not end
    block = min(10, steps)
    blocks = min(config.loop_blocks, steps // block)
    bare = _engine(config, config.slots, mesh)
    worker = _full_worker(config, _engine(config, config.slots, mesh), params, pipelined=True)
    loops = {
        "bare": _bare_loop(
            bare, params, _fill(bare, params, bare.init_decode_state(), config.slots, config.prompt_length, rng)
        ),
        "worker": _worker_loop(worker),
        "unpipelined_worker": _worker_loop(
            _full_worker(config, _engine(config, config.slots, mesh), params, pipelined=False)
        ),
    }
    if config.page_size and config.compare_dense:
        dense = _engine(config, config.slots, mesh, paged=False)
        dense.warmup(params, migration=False)
        loops["dense_worker"] = _worker_loop(_full_worker(config, dense, params, pipelined=True))
    names = list(loops)
    times = {name: [] for name in names}
    for turn in range(blocks):
        for name in names[turn % len(names) :] + names[: turn % len(names)]:
            start = time.perf_counter()
            loops[name](block)
            times[name].append((time.perf_counter() - start) / block)
    medians = {f"{name}_step_time_s": float(np.median(t)) for name, t in times.items()}
    ratio = lambda a, b: float(np.median(np.asarray(times[a]) / np.asarray(times[b])))  # noqa: E731
    result = medians | {  # ratios of the same turn's blocks (the load drifts between turns)
        "worker_overhead": ratio("worker", "bare"),
        "unpipelined_worker_overhead": ratio("unpipelined_worker", "bare"),
        "block_steps": block,
        "blocks": blocks,
    }
    if "dense_worker" in times:  # > 1: the paged worker makes more tokens per second than the dense one
        result["paged_speedup_over_dense"] = ratio("dense_worker", "worker")
    return result, worker


def _kv_figures(engine: RolloutEngine, worker: RolloutWorker) -> dict:
    """The KV cache. Dense: every slot holds `cache_length` rows whatever its request's length, so
    a live token costs bytes_per_token x capacity_tokens / live_tokens (live: the prompt and
    response tokens of `worker`'s requests, all slots busy). Paged: a live token costs the pages its
    slot holds; the pool holds `capacity_tokens` tokens, `capacity_sequences_at_mean_length`
    sequences of the workload's mean length (live tokens / busy slots)."""
    if engine.config.paged:
        return _paged_kv_figures(worker.engine, worker)
    sizes, cache = engine.config, engine.abstract_decode_state().cache
    cache_bytes = sum(math.prod(c.shape) * c.dtype.itemsize for c in (cache.k_LBSKD, cache.v_LBSKD))
    # = layers x 2 (k, v) x kv_heads x head_dim x dtype bytes per row, cache_length rows per slot
    per_token = cache_bytes // (sizes.num_slots * sizes.cache_length)
    live = sum(len(r.prompt_ids) + len(r.prefix_response_ids) for r in worker.progress().values())
    return {
        "bytes_per_token": per_token,
        "bytes_per_slot": per_token * sizes.cache_length,
        "cache_bytes": cache_bytes,
        "capacity_slots": sizes.num_slots,
        "capacity_tokens": sizes.num_slots * sizes.cache_length,
        "live_tokens": live,
        "bytes_per_live_token": cache_bytes / live,
    }


def _paged_kv_figures(engine: RolloutEngine, worker: RolloutWorker) -> dict:
    sizes, pool = engine.config, engine.pages
    arrays = jax.tree.leaves(engine.abstract_decode_state().cache)  # per layer: combined, or keys and values
    cache_bytes = sum(math.prod(c.shape) * c.dtype.itemsize for c in arrays)
    page_bytes = cache_bytes // sizes.pool_pages
    live = sum(len(r.prompt_ids) + len(r.prefix_response_ids) for r in worker.progress().values())
    held = pool.capacity_pages - pool.free_pages
    mean_length = live / max(1, worker.num_active)
    return {
        "page_size": sizes.page_size,
        "bytes_per_token": page_bytes // sizes.page_size,
        "bytes_per_page": page_bytes,
        "cache_bytes": cache_bytes,
        "capacity_slots": sizes.num_slots,
        "capacity_tokens": pool.capacity_pages * sizes.page_size,
        "live_tokens": live,
        "held_pages": held,
        "bytes_per_live_token": held * page_bytes / live,
        "mean_length": mean_length,
        "capacity_sequences_at_mean_length": int(pool.capacity_pages * sizes.page_size // mean_length),
    }


def _measure_prefill(config: EngineBenchConfig, engine, params, rng) -> list[dict]:
    rows = []
    for bucket in engine.config.prefill_buckets:
        tokens = rng.integers(0, config.vocab_size, bucket).astype(np.int32)
        jax.block_until_ready(engine.prefill(params=params, padded_tokens=tokens, true_length=bucket))
        times = []
        for _ in range(config.prefill_repeats):
            start = time.perf_counter()
            jax.block_until_ready(engine.prefill(params=params, padded_tokens=tokens, true_length=bucket))
            times.append(time.perf_counter() - start)
        seconds = float(np.median(times))
        rows.append({"bucket": bucket, "time_s": seconds, "tokens_per_s": bucket / seconds})
    return rows


def _workload_prompts(config: EngineBenchConfig, rng: np.random.Generator) -> list[PrefillRequest]:
    return [
        PrefillRequest(
            slot=i,
            tokens=rng.integers(0, config.vocab_size, config.prompt_length).astype(np.int32),
            sampling=SamplingParams(temperature=1.0, seed=i),
        )
        for i in range(min(config.workload_sequences, config.slots))
    ]


def _one_at_a_time(engine: RolloutEngine, params, prompts, new_tokens: int) -> tuple[float, float, np.ndarray]:
    """(prefill s, decode s, tokens [n, new_tokens]): a prefill and insert per prompt, each first
    token read; then every decode step's tokens read before the next step is dispatched."""
    start, state, columns = time.perf_counter(), engine.init_decode_state(), []
    first = []
    for p in prompts:
        prefix, result = engine.prefill(
            params=params, padded_tokens=p.tokens, true_length=len(p.tokens), sampling=p.sampling
        )
        state = engine.insert(prefix, state, p.slot)
        first.append(int(jax.device_get(result.data)[0, 0]))
    jax.block_until_ready(state)
    prefilled = time.perf_counter()
    columns.append(np.asarray(first))
    for _ in range(new_tokens - 1):
        state, result = engine.generate(params, state)
        data, _ = jax.device_get((result.data, result.log_prob))
        columns.append(data[: len(prompts), 0])
    return prefilled - start, time.perf_counter() - prefilled, np.stack(columns, axis=1)


def _batched(engine: RolloutEngine, params, prompts, new_tokens: int) -> tuple[float, float, np.ndarray]:
    """(prefill s, decode s, tokens): batched prefills, then each decode step dispatched before the
    previous one's tokens are read (copied to host meanwhile)."""
    start = time.perf_counter()
    state, programs = engine.prefill_insert(params, engine.init_decode_state(), prompts)
    jax.block_until_ready(state)
    prefilled = time.perf_counter()
    first = np.zeros((len(prompts),), np.int64)
    for result, members in programs:
        first[list(members)] = jax.device_get(result.data)[: len(members), 0]
    columns, unread = [first], []
    for _ in range(new_tokens - 1):
        state, result = engine.generate(params, state)
        result.copy_to_host_async()
        unread.append(result)
        if len(unread) > 1:
            columns.append(unread.pop(0).convert_to_numpy().data[: len(prompts), 0])
    columns += [u.convert_to_numpy().data[: len(prompts), 0] for u in unread]
    return prefilled - start, time.perf_counter() - prefilled, np.stack(columns, axis=1)


def _measure_workload(config: EngineBenchConfig, engine: RolloutEngine, params, rng) -> dict:
    """The end-to-end workload both ways, alternating, medians of the rounds (see the module docstring)."""
    prompts = _workload_prompts(config, rng)
    paths = {"one_at_a_time": _one_at_a_time, "batched": _batched}
    tokens = {name: run(engine, params, prompts, config.workload_new_tokens)[2] for name, run in paths.items()}
    if not np.array_equal(tokens["one_at_a_time"], tokens["batched"]):
        raise AssertionError("bench engine: the batched workload sampled other tokens than the one-at-a-time one")
    times = {name: [] for name in paths}
    names = list(paths)
    for round_ in range(config.workload_rounds):
        for name in names[round_ % 2 :] + names[: round_ % 2]:
            prefill_s, decode_s, _ = paths[name](engine, params, prompts, config.workload_new_tokens)
            times[name].append((prefill_s, decode_s))
    generated = len(prompts) * config.workload_new_tokens
    out = {
        "sequences": len(prompts),
        "prompt_length": config.prompt_length,
        "new_tokens": config.workload_new_tokens,
        "rounds": config.workload_rounds,
        "same_tokens": True,
    }
    for name, rounds in times.items():
        total = [p + d for p, d in rounds]
        out[name] = {
            "seconds": float(np.median(total)),
            "prefill_s": float(np.median([p for p, _ in rounds])),
            "decode_step_s": float(np.median([d for _, d in rounds])) / max(1, config.workload_new_tokens - 1),
            "prefill_share": float(np.median([p / (p + d) for p, d in rounds])),
            "tokens_per_s": generated / float(np.median(total)),
            "rounds_s": total,
        }
    ratios = np.asarray(out["one_at_a_time"]["rounds_s"]) / np.asarray(out["batched"]["rounds_s"])
    out["speedup"] = float(np.median(ratios))  # the same round's pair (the load drifts between rounds)
    return out


def _measure_migration(config: EngineBenchConfig, params) -> list[dict] | None:
    """`dora_jax.bench.migration` on two slices of the engine under test (None without the devices)."""
    tp = config.tensor_parallel
    if len(jax.devices()) < 2 * tp:
        return None
    engines = [
        _engine(config, config.slots, sharding.make_mesh(jax.devices()[i * tp : (i + 1) * tp], {"tensor": tp}))
        for i in (0, 1)
    ]
    for engine in engines:
        engine.warmup(engine.load_params(params))
    return measure_migration(engines, params, repeats=config.migration_repeats, vocab_size=config.vocab_size)


def run_engine_bench(config: EngineBenchConfig, out_dir: str | None) -> dict:
    """Runs every measurement; writes `out_dir/engine.json` (when given) and returns the same dict."""
    devices = jax.devices()[: config.tensor_parallel]
    mesh = sharding.make_mesh(devices, {"tensor": config.tensor_parallel})
    engine = _engine(config, config.slots, mesh)
    params = engine.load_params(split(init_model(_model_config(config), seed=config.seed))[1])
    rng = np.random.default_rng(config.seed)
    engine.warmup(params, migration=False)
    compiled = engine.compile_counts()
    if config.workload_only:
        results = {"workload": _measure_workload(config, engine, params, rng)}
        after = engine.compile_counts()
        results |= {
            "compiles_after_warmup": sum(after[name] - compiled[name] for name in after),
            "model": dataclasses.asdict(config) | {"params": int(sum(x.size for x in jax.tree.leaves(params)))},
            "slots": config.slots,
            "devices": [str(d) for d in devices],
        }
        _write(results, out_dir)
        return results
    workload = _measure_workload(config, engine, params, rng)
    decode = _measure_decode(config, engine, params, mesh, rng)
    worker_loop, worker = _measure_worker_loop(config, mesh, params, rng)
    decode[-1]["worker_step_time_s"] = worker_loop["worker_step_time_s"]
    prefill = _measure_prefill(config, engine, params, rng)
    after = engine.compile_counts()
    moves = _measure_migration(config, params) if config.migration else None
    results = {
        "decode": decode,
        "prefill": prefill,
        "worker_loop": worker_loop,
        "workload": workload,
        "kv": _kv_figures(engine, worker),
        "compiles_after_warmup": sum(after[name] - compiled[name] for name in after),
        "model": dataclasses.asdict(config) | {"params": int(sum(x.size for x in jax.tree.leaves(params)))},
        "slots": config.slots,
        "devices": [str(d) for d in devices],
    }
    if moves is not None:
        results["migration"] = moves
    if config.batch_curve:
        by_slots = {p["active_slots"]: p["batch_step_time_s"] for p in decode}
        results["flat_ratio"] = by_slots[config.slots] / by_slots[1]
    _write(results, out_dir)
    return results


def _write(results: dict, out_dir: str | None) -> None:
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "engine.json"), "w") as f:
            json.dump(results, f, indent=1)


def _workload_lines(work: dict) -> list[str]:
    lines = [
        f"workload: {work['sequences']} x ({work['prompt_length']} + {work['new_tokens']}) tokens, "
        f"medians of {work['rounds']} rounds side by side"
    ]
    lines.append(f"{'path':>14} {'tokens/s':>9} {'total ms':>9} {'prefill ms':>10} {'share':>6} {'step ms':>8}")
    for name in ("one_at_a_time", "batched"):
        p = work[name]
        lines.append(
            f"{name:>14} {p['tokens_per_s']:9.0f} {1e3 * p['seconds']:9.1f} {1e3 * p['prefill_s']:10.1f} "
            f"{p['prefill_share']:6.2f} {1e3 * p['decode_step_s']:8.3f}"
        )
    lines.append(f"batched / one-at-a-time tokens/s: {work['speedup']:.2f}x (same tokens: {work['same_tokens']})")
    return lines


def format_table(results: dict) -> str:
    """The decode and prefill tables as text."""
    if "decode" not in results:  # workload_only
        return "\n".join(
            _workload_lines(results["workload"]) + [f"compiles after warm-up: {results['compiles_after_warmup']}"]
        )
    lines = [f"{'active':>6} {'occupancy':>9} {'step ms':>8} {'tokens/s':>9} {'B-sized step ms':>15}"]
    for p in results["decode"]:
        sized = f"{1e3 * p['batch_step_time_s']:15.3f}" if "batch_step_time_s" in p else f"{'-':>15}"
        lines.append(
            f"{p['active_slots']:6d} {p['occupancy']:9.2f} {1e3 * p['step_time_s']:8.3f} "
            f"{p['tokens_per_s']:9.0f} {sized}"
        )
    lines.append(f"{'bucket':>6} {'prefill ms':>10} {'tokens/s':>9}")
    lines += [f"{r['bucket']:6d} {1e3 * r['time_s']:10.3f} {r['tokens_per_s']:9.0f}" for r in results["prefill"]]
    loop, kv = results["worker_loop"], results["kv"]
    lines.append(
        f"full occupancy, ms per step: bare decode {1e3 * loop['bare_step_time_s']:.3f}, RolloutWorker.step() "
        f"{1e3 * loop['worker_step_time_s']:.3f} ({loop['worker_overhead']:.2f}x), unpipelined "
        f"{1e3 * loop['unpipelined_worker_step_time_s']:.3f} ({loop['unpipelined_worker_overhead']:.2f}x)"
    )
    if "paged_speedup_over_dense" in loop:
        lines.append(
            f"paged worker vs dense worker, side by side: dense {1e3 * loop['dense_worker_step_time_s']:.3f} ms "
            f"per step, paged {loop['paged_speedup_over_dense']:.2f}x the dense tokens/s"
        )
    lines.append(
        f"KV cache: {kv['cache_bytes']} bytes for {kv['capacity_slots']} slots, {kv['capacity_tokens']} tokens; "
        f"{kv['bytes_per_token']} bytes per token row, {kv['bytes_per_live_token']:.0f} per live token"
        + (
            f"; pages of {kv['page_size']}: {kv['capacity_sequences_at_mean_length']} sequences of the mean "
            f"length {kv['mean_length']:.0f}"
            if "page_size" in kv
            else ""
        )
    )
    lines += _workload_lines(results["workload"])
    lines.append(f"compiles after warm-up: {results['compiles_after_warmup']}")
    if results.get("migration"):
        lines.append(
            f"{'migrate':>7} {'KV bytes':>9} {'transfer ms':>11} {'host ms':>8} {'re-prefill ms':>13} {'rule':>9}"
        )
        lines += [
            f"{m['prefix_tokens']:7d} {m['kv_bytes_moved']:9d} {1e3 * m['kv_transfer_s']:11.3f} "
            f"{1e3 * m['kv_host_s']:8.3f} {1e3 * m['reprefill_s']:13.3f} {m['rule']:>9}"
            for m in results["migration"]
        ]
    if "flat_ratio" in results:
        lines.append(f"full-batch step / one-slot step: {results['flat_ratio']:.2f}x (flat regime: <= 1.5x)")
    return "\n".join(lines)


_FLAG_TYPES = {"int": int, "str": str, "bool": lambda text: text.lower() in ("1", "true", "yes")}


def main(argv: Sequence[str] | None = None) -> dict:
    """`python -m dora_jax.bench engine --out=DIR [--slots=32 ...]`: any config field as a flag."""
    parser = argparse.ArgumentParser(prog="bench engine", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="directory for engine.json")
    for field in dataclasses.fields(EngineBenchConfig):
        parser.add_argument(f"--{field.name}", type=_FLAG_TYPES[field.type], default=field.default)
    args = vars(parser.parse_args(argv))
    out = args.pop("out")
    results = run_engine_bench(EngineBenchConfig(**args), out)
    print(format_table(results))
    return results


if __name__ == "__main__":
    main()
