"""Trace-driven long-tail benchmark: the four modes on the same forced-length workload.

    python -m dora_jax.bench modes --config=configs/bench_longtail.py --out=/tmp/bench_modes
    python -m dora_jax.bench engine --config=configs/bench_longtail.py --out=/tmp/bench_engine

Response lengths: log-normal, the paper's median 2.4K / max 30K tokens scaled down 100x to
median 24 / cap 300 (the paper's 12.5x max/median), with sigma 1.1 so that one batch's longest
response is ~5-10x its mean (what makes sync's bubbles 74-88% in the paper), and a tiny model
decodes them in minutes.

Roles run as on a pod, on their own hardware: each mode is a `launch_local` job with the trainer on
one core and the rollout workers on the other (`bench.trainer_cores`). Calibrated (2026-12-03) to
the paper's regime: sync's bubble ratio 0.74-0.88 and rollout-only share 0.55-0.75 (train about a
third of the sync step), and a batch's straggler shorter than K of dora's train steps. Against the
earlier shared-core config (hidden 64, 16 slots, batch 32): the model is 4x wider in its MLP and
2x in hidden (a 64-wide model's decode step is ~1 ms, so per-step host work and version switches,
not decoding, set every mode's pace), and the batch is 64 samples on 2 x 32 slots (training a
third of the sync step). `--config.bench.trainer_cores=0` runs the embedded, shared-core bench.
"""

import importlib.util
import os


def get_config(arg=None):
    spec = importlib.util.spec_from_file_location("smoke", os.path.join(os.path.dirname(__file__), "smoke.py"))
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    c = smoke.get_config(arg)
    with c.unlocked():
        # Training steps per mode: 8 flattered dora (an empty window at the start; see docs/performance.md).
        c.num_steps = 24
        c.init.sft_steps = 0  # no learning: lengths are forced
        c.model.hidden_size = 128
        c.model.intermediate_size = 512
        c.model.head_dim = 32
        c.task.k_max = 8  # short prompts: the work is in decoding
        c.rollout.num_slices = 2
        c.rollout.slots = 32
        c.rollout.cache_length = 320  # prompt (<= 18) + response (<= 300)
        c.rollout.max_prefill_length = 256  # partial rollout re-prefills prompt + response so far: <= 2 chunks
        c.rollout.max_new_tokens = 300
        c.coordinator.group_size = 4
        c.coordinator.train_batch_size = 64
        c.coordinator.rollout_batch_size = (
            192  # decoding at once; the version window (<= (K + 1) x TBS unconsumed) binds first
        )
        c.coordinator.k_max = 3
        c.trainer.micro_batch_size = 8
        c.trainer.pad_to = 320  # the batch-wide shape when length_bucket = 0 (prompt <= 18 + response <= 300)
        c.trainer.length_bucket = 16  # each micro-batch padded to its own 16 * 2^k: short rows cost short forwards
        c.trainer.micro_batch_tokens = (
            1024  # long rows 2 to a micro-batch, short ones up to 32 (fewer padded positions)
        )
        # One fake device for the trainer: fake devices share the same 2 cores, so fsdp=2 adds collectives
        # (~16 ms per micro-batch gradient here) and no compute.
        c.mesh.trainer = {"fsdp": 1}
        c.log.tensorboard = False
        c.eval.every_steps = 0  # a throughput bench: no evaluation rounds on the slices
        # Versions through the tensorstore tier (written in the background by the trainer), as the smoke
        # config. Device to device (`rollout.weights_transfer`) loads a version in ~10 ms instead of ~0.1 s
        # (`bench weights`) but measured no faster here: one round each, sync 64.4 s vs 64.2 s, dora 23.7 s
        # vs 30.3 s (its train steps took 19.0 s vs 22.1 s; not explained).
        c.bench = {
            "median_len": 24.0,
            "sigma": 1.1,
            "max_len": 300,  # forced response lengths (tokens)
            "rounds": 3,  # every mode 3 times, interleaved; results.json reports medians (a shared, noisy machine)
            # Roles on disjoint cores, as a pod gives the trainer and the rollout slices their own chips:
            # each mode a launch_local job, the trainer on 1 core, the rollout workers on the rest.
            # 0: the embedded run (every role a thread of one process, on every core).
            "trainer_cores": 1,
            "modes": ("sync", "one_step_off", "partial_rollout", "dora"),
            "warmup": True,  # first one dora job that fills JAX's compilation cache for the timed ones
            "timeout_s": 3600.0,  # one mode's job
        }
    c.lock()
    return c
