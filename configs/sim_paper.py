"""Simulator config: the DORA paper's Qwen2.5-32B (dense) runs on 64 and 128 GPUs, and a sweep.

    python -m dora_jax.sim --config=configs/sim_paper.py --out=/tmp/sim_out
    python -m dora_jax.sim --config=configs/sim_paper.py --out=/tmp/sim_out --calibrate
    python -m dora_jax.sim --config=configs/sim_paper.py --out=/tmp/sim_out --config.run.k_max=1
    python -m dora_jax.sim --config=configs/sim_paper.py --out=/tmp/sim_out --jobs=1  # one process, not one per core
    python -m dora_jax.sim --config=configs/sim_paper.py --out=/tmp/sim_out --ledger  # + every run's ledger
    python -m dora_jax.audit /tmp/sim_out/64gpus_dora.ledger.jsonl  # the project's auditor on one of them
    python -m dora_jax.sim --config=configs/sim_paper.py --out=/tmp/proj_7b \
        --compile=/tmp/7b_trainer/compile.json --compile=/tmp/7b_rollout/compile.json  # a real config, projected

How the constants were chosen (see dora_jax/sim/calibrate.py; `--calibrate` re-runs the fit):
- Hardware-derived (80 GB GPUs, H800/H100 class): one rollout group = 4 GPUs (tensor parallel;
  32B bf16 weights are 64 GB); KV bytes/token = 64 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes
  = 262 KB; slots = KV budget / time-weighted mean context: (4 x 80 GB x 0.9 - 64 GB) / 262 KB
  = 854K tokens over ~4.4K tokens per slot -> 192 slots; prefill ~33K tokens/s per group;
  25 GB/s point-to-point KV transfer; 5 s to load another version's weights.
- decode t1 (seconds per extra active slot) = KV bytes a slot reads per step / group HBM bandwidth
  + one token's matmuls / group compute: 262 KB/token x ~4.4K tokens of time-weighted mean context
  (2K prompt + E[L^2]/2E[L] of the response distribution) = 1.15 GB over 4 x 3.35 TB/s x 60%
  = 0.143 ms, plus 2 x 32e9 FLOP over 4 x 989 TFLOP/s x 50% = 0.032 ms -> 0.175 ms.
- Fitted to the paper's *synchronous* rows only: train time = (1 - rollout share) x step time at
  64 and 128 GPUs -> trainer fixed + per-token cost; sync rollout time at 64 GPUs -> decode t0.
  Sync at 128 GPUs and every asynchronous number are then predictions of the model, not fits.
- Placement follows what the paper's rows imply: sync and partial rollout colocated (their train
  share is ~ sync's full-cluster train time), one-step-off and DORA on a trainer/rollout split.
The policies are not configured here: every mode is the shipped coordinator (dora_jax/core/modes.py,
dora_jax/coordinator/) with its own settings (k_max, RBS, rebalance period).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    c.workload = ml_collections.ConfigDict()
    c.workload.prompts_per_step = 512  # B: prompts per training batch
    c.workload.samples_per_prompt = 16  # G: responses per prompt
    c.workload.prompt_tokens = 2048  # prompt length (the paper's 2K prompt budget)
    c.workload.median_response = 2400.0  # median response tokens
    c.workload.max_response = 30720  # max_new_tokens (30K)
    c.workload.max_over_median = 12.0  # expected longest response of a 512 x 16 batch / median
    c.workload.prompt_correlation = 0.5  # share of log-length variance common to a prompt's G samples
    c.workload.seed = 0

    c.engine = ml_collections.ConfigDict()
    c.engine.accelerators_per_group = 4  # GPUs per rollout (data-parallel) group
    c.engine.slots_per_group = 192  # concurrent decode slots per group (KV budget, see docstring)
    c.engine.decode_t0_s = 0.01926  # decode step time at 1 active slot (fitted, see docstring)
    c.engine.decode_t1_s = 0.000175  # extra step time per active slot (HBM-derived, see docstring)
    c.engine.bench_json = ""  # path to `bench engine` JSON: if set, t0/t1 are fitted from it instead
    c.engine.prefill_s_per_token = 3.0e-5  # group seconds per prefilled token
    c.engine.weight_load_s = 5.0  # group stall to switch to another version's weights
    c.engine.kv_bytes_per_token = 262144.0  # Qwen2.5-32B: 64 x 8 x 128 x 2 x 2 bytes
    c.engine.migrate_bytes_per_s = 25.0e9  # KV-cache migration bandwidth between groups

    c.trainer = ml_collections.ConfigDict()
    c.trainer.train_s_per_token = 0.0004712  # GPU-seconds per trained token (fitted)
    c.trainer.train_fixed_s = 174.3  # per-step trainer seconds that do not shrink with GPUs (fitted)

    c.run = ml_collections.ConfigDict()
    c.run.modes = ("sync", "one_step_off", "partial_rollout", "dora")
    c.run.k_max = 3  # DORA's version window (and the staleness bound audited for partial rollout)
    c.run.steps = 8  # training steps simulated per mode
    c.run.warmup = 2  # first steps left out of the measurements (pipeline fill)
    c.run.rbs_factor = 1.5  # RBS / TBS: samples kept in flight by dora and partial_rollout
    c.run.chunk_tokens = 8.0  # requests within this many tokens of finishing finish together
    c.run.rebalance_period_s = 30.0  # the coordinator's periodic rebalance trigger (simulated seconds)
    c.run.coordinator_tick_s = 1.0  # the coordinator applies posted events at most this often (0: after each)
    c.run.legacy_fill = False  # dora: new groups at an older version in its idle slots while C3 allows

    c.placement = ml_collections.ConfigDict()
    c.placement.sync = "colocated"  # sync: every GPU rolls out, then every GPU trains
    c.placement.one_step_off = "split"  # overlapping modes need distinct trainer GPUs
    c.placement.partial_rollout = "colocated"  # rollout pauses (KV evicted) while all GPUs train
    c.placement.dora = "split"
    c.placement.node_size = 8  # trainer/rollout split granularity (GPUs per host)
    c.placement.train_accelerators = 0  # > 0: fixed trainer GPUs for split modes
    # Trainer share of split modes, in whole nodes (0: balance full-occupancy rollout and train
    # work instead). Half is what the paper's DORA rows imply: step x (1 - rollout share) is
    # 12.9 / 7.95 min at 64 / 128 GPUs, which T(n) above gives at n = 32 / 64.
    c.placement.train_fraction = 0.5

    c.settings = (64, 128)  # GPU counts compared with the paper's tables

    c.sweep = ml_collections.ConfigDict()
    # The sizes issue 22 measures the coordinator at (its orchestration share of the step is in
    # results.json); 4 steps, the first left out. The full sweep:
    # --config.sweep.accelerators="(64,128,256,512,1024,2048,4096)" --config.sweep.steps=6 --config.sweep.warmup=2
    c.sweep.accelerators = (64, 512, 4096)
    c.sweep.steps = 4
    c.sweep.warmup = 1
    c.sweep.batch_scaling = "fixed"  # fixed: 512 x 16 per step at every size; proportional: B x n/64

    # Projection of a real config from its `python -m dora_jax.tpu_compile` estimates instead of the
    # paper's GPUs (dora_jax/sim/projection.py): --compile=DIR/compile.json (repeated, or comma-separated).
    # The pod, batch, K, RBS and costs then come from the compile.json; from this config only the
    # response-length shape (workload.median_response / max_response, max_over_median,
    # prompt_correlation, seed), run.modes/steps/warmup/chunk_tokens/coordinator_tick_s and these.
    # The bandwidths are assumptions, not measurements:
    c.projection = ml_collections.ConfigDict()
    # A rollout slice reading a new version from the ParamStore's tensorstore tier (gs:// in the
    # pod configs) into its chips: ~40 Gb/s per TPU VM host of GCS reads.
    c.projection.weight_load_bytes_per_s = 5.0e9
    # One request's KV cache exported by one slice and imported by another (a gRPC stream of
    # protobuf over the data-centre network, through host memory at both ends): ~8 Gb/s.
    c.projection.migrate_bytes_per_s = 1.0e9
    c.projection.prompt_tokens = 0  # 0: the config's task.source.max_prompt_tokens (its budget); > 0: this

    c.paper = ml_collections.ConfigDict()  # PAPER.md's tables (None: not reported)
    c.paper.gpus_64 = dict(
        rollout_only_share=dict(sync=0.65, one_step_off=0.33, partial_rollout=0.46, dora=0.12),
        step_time_min=dict(sync=22.91, one_step_off=22.94, partial_rollout=17.38, dora=14.67),
        tokens_per_s=dict(sync=14143, one_step_off=14141, partial_rollout=19872, dora=23327),
        rollout_speedup_vs_sync=8.2,
        dora_vs_sync=1.65,
    )
    c.paper.gpus_128 = dict(
        rollout_only_share=dict(sync=0.73, one_step_off=None, partial_rollout=None, dora=0.24),
        step_time_min=dict(sync=20.23, one_step_off=None, partial_rollout=13.95, dora=10.46),
        tokens_per_s=dict(sync=16070, one_step_off=None, partial_rollout=None, dora=34135),
        rollout_speedup_vs_sync=5.9,
        dora_vs_sync=2.12,
    )
    c.paper.dora_vs_best_other_async = (1.11, 1.47)

    c.lock()
    return c
