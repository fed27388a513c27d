"""Smoke run: DORA on the running-sums task with a tiny char-level model, on a laptop CPU.

    python -m dora_jax.train --config=configs/smoke.py --workdir=/tmp/dora_smoke
    python -m dora_jax.train --config=configs/smoke.py --workdir=/tmp/dora_sync --config.mode=sync
    python -m dora_jax.audit /tmp/dora_smoke

On CPU the local devices are 8 fake ones (`mesh.fake_cpu_devices`): a trainer slice of 2 and
3 rollout slices of 1, each decoding 2 sequences at a time. Rollout capacity is kept that small on
purpose: the 2-core machine trains this model more slowly than it samples from it, and with more
slots every batch finishes before the next publish, so there is nothing in flight for DORA to
orchestrate (or for partial rollout to interrupt). With 3 x 2 slots generation and training take
about as long, as on the long-tailed workloads DORA is for.

Without `init.checkpoint` the run first trains the model briefly on correct demonstrations (35
updates, cached in WORKDIR/sft), stopped early on purpose: its
samples are right about 9% of the time while its greedy answers are right 50% of the time, so RL
has room to sharpen and then extend the skill; over 250 steps the mean reward rises to about 0.48.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    del arg
    c = ml_collections.ConfigDict()
    c.mode = "dora"  # sync | one_step_off | partial_rollout | dora
    c.num_steps = ml_collections.FieldReference(
        250
    )  # training steps (= versions published); about 1 s each on 2 CPU cores
    c.seed = 0  # model init, prompt order, sampling seeds
    # Every role compiles each program it can run before the run starts, so none compiles mid-run
    # (False: each when first used, a faster start for short runs).
    c.compile_ahead = True

    c.model = ml_collections.ConfigDict()
    c.model.hf_path = ""  # a HF checkpoint directory; "" = a fresh tiny model from the fields below
    c.model.num_layers = 2  # decoder blocks
    c.model.hidden_size = 128  # embed width
    c.model.intermediate_size = 256  # SwiGLU width
    c.model.num_heads = 4  # query heads
    c.model.num_kv_heads = 2  # key/value heads (GQA)
    c.model.head_dim = 32  # per-head width
    c.model.dtype = "float32"  # compute dtype: float32 | bfloat16
    c.model.param_dtype = "float32"  # storage dtype of params
    c.model.remat = "none"  # what the backward pass recomputes: "none" | "dots" | "full"
    c.model.scan_layers = False  # the trainer's blocks as one lax.scan (the TPU configs: True)
    c.model.num_experts = 0  # > 0: a Qwen3-MoE with this many experts per layer (configs/smoke_moe.py)
    c.model.num_experts_per_tok = 0  # MoE: experts per token (top-k)
    c.model.moe_intermediate_size = 0  # MoE: each expert's SwiGLU width
    c.model.norm_topk_prob = False  # MoE: renormalise the top-k routing weights
    c.model.moe_dispatch = "grouped"  # MoE: "dense" | "grouped" computation (same numbers)

    c.init = ml_collections.ConfigDict()
    c.init.checkpoint = ""  # a HF checkpoint dir to start RL from; "" = SFT cold start in WORKDIR/sft
    c.init.sft_steps = 35  # SFT updates for the cold start, stopped early on purpose (measured on 256 prompts:
    # 35 updates: sampled 9%, greedy 50%; 50: 33% / 60%); RL sharpens and extends the same skill
    c.init.sft_batch_size = 32  # demonstrations per SFT update
    c.init.sft_lr = 3e-3  # SFT learning rate

    c.task = ml_collections.ConfigDict()
    c.task.kind = "running_sums"  # running_sums | gsm8k | math
    c.task.median_k = 2.0  # running_sums: median number of terms (2: 59% of prompts have k <= 2, which the
    # tiny model masters; with 3 RL plateaued near 0.37, the share of k <= 2 it could master)
    c.task.sigma = 1.0  # running_sums: log-normal shape of the number of terms (the long tail)
    c.task.k_max = 40  # running_sums: most terms in one prompt
    c.task.max_term = 2  # running_sums: terms are 0..max_term (2: the step is a 30-entry table a tiny model learns)
    c.task.reward_workers = 2  # reward processes
    c.task.reward_timeout_s = 10.0  # per-sample reward timeout

    c.mesh = ml_collections.ConfigDict()
    c.mesh.fake_cpu_devices = 8  # on CPU only: XLA host devices to fake (0 = leave XLA_FLAGS alone)
    c.mesh.trainer = ml_collections.ConfigDict({"fsdp": 2})  # trainer slice mesh shape
    c.mesh.rollout = ml_collections.ConfigDict({"tensor": 1})  # each rollout slice's mesh shape
    c.mesh.time_shared = False  # allow slices to share devices (one Colab GPU / TPU core)

    c.rollout = ml_collections.ConfigDict()
    c.rollout.num_slices = 3  # rollout slices (data-parallel rollout groups)
    c.rollout.slots = 2  # concurrent decodes per slice (see the docstring: 8 left the run trainer-bound)
    c.rollout.cache_length = 256  # prompt + response tokens per slot
    c.rollout.max_prefill_length = 128  # largest prefill bucket (power of two)
    c.rollout.temperature = 1.0  # sampling temperature (0 = greedy)
    c.rollout.top_p = 1.0  # nucleus filter (1 = off)
    c.rollout.top_k = 0  # top-k filter (0 = off)
    c.rollout.max_new_tokens = 128  # response cap (k_max = 40 terms: 3 x 40 + 2 characters + EOS = 123)
    c.rollout.heartbeat_timeout_s = 120.0  # a slice silent this long is declared dead, its requests re-dispatched
    c.rollout.max_rejoins = 2  # times a crashed slice is restarted and rejoins
    c.rollout.weights_transfer = False  # role processes: pull versions device to device from the trainer
    c.rollout.page_size = 16  # paged KV cache: rows per page (0 = dense: every slot holds cache_length rows)
    c.rollout.kv_pages = 0  # pages in the pool (0 = sized by kv_memory_fraction; CPU: every slot full)
    c.rollout.kv_memory_fraction = 0.8  # the pool's share of chip memory left after the weights
    c.rollout.migration = "auto"  # a migrated request moves its KV or is re-prefilled, whichever costs less
    c.rollout.kv_link_bytes_per_s = 0.0  # link between slices, bytes/s (0: unknown until the first KV move is measured)
    c.rollout.min_prefill_bucket = 0  # smallest prefill bucket, a power of two (0: the page size, at least 16)

    c.coordinator = ml_collections.ConfigDict()
    c.coordinator.k_max = 2  # K: most versions a consumed trajectory may lag the trainer
    c.coordinator.group_size = 4  # G samples per prompt
    c.coordinator.train_batch_size = 128  # TBS samples per training step (32 prompts: with 16 a step's mean
    # reward swung by +-0.1 with the batch's mix of short and long prompts, and learning was slower)
    c.coordinator.rollout_batch_size = 192  # RBS samples in flight (dora / partial_rollout)
    c.coordinator.rebalance_period_s = 0.5  # periodic orchestrator trigger
    # dora: new groups at an older version in that version's idle slots, only while the trainer can
    # still take them within K (coordinator/legacy_fill.py); off by default: with long tails its
    # deadline rarely admits a group (docs/performance.md)
    c.coordinator.legacy_fill = False
    # the loop applies finished results while a slice runs a command: a submit, a version load, a migration's
    # export or import (coordinator/port_calls.py); False: it waits, and a switch holds up the trainer
    c.coordinator.apply_results_during_calls = True
    # with trainer.dynamic_sampling: most batches' worth of groups filtered between two takes before the
    # run stops as saturated (0: no limit; docs/dynamic_sampling.md)
    c.coordinator.max_filtered_batches_per_step = 10

    c.trainer = ml_collections.ConfigDict()
    c.trainer.lr = 5e-4  # AdamW peak learning rate (1e-3 collapsed the entropy to 0.15 and the reward with it)
    c.trainer.warmup_steps = 0  # linear warm-up updates
    c.trainer.schedule = "cosine"  # constant | cosine (decays to lr * final_lr_fraction at decay_steps)
    c.trainer.final_lr_fraction = 0.1  # end of the cosine decay
    c.trainer.clip_grad_norm = 1.0  # global-norm gradient clip
    c.trainer.eps_low = 0.2  # PPO clip below
    c.trainer.eps_high = 0.28  # PPO clip above (DAPO clip-higher)
    c.trainer.dual_clip = 3.0  # dual-clip bound for negative advantages
    c.trainer.tis_cap = 2.0  # truncated importance weight cap (0 = off)
    c.trainer.loss_norm = "constant"  # token_mean | seq_mean_token_mean | constant (Dr. GRPO: every token
    # weighs the same; with seq_mean_token_mean wrong answers grew longer, 12 -> 40 tokens, as each of their
    # tokens was penalised less)
    c.trainer.advantage = "dr_grpo"  # grpo | dr_grpo | rloo (dr_grpo: no division by the group's std)
    c.trainer.num_updates = ml_collections.FieldReference(1)  # optimizer updates per batch
    c.trainer.decay_steps = c.get_ref("num_steps") * c.trainer.get_ref("num_updates")  # cosine: the whole run
    c.trainer.micro_batch_size = 16  # rows per forward/backward
    c.trainer.pad_to = 32  # sequence lengths are padded to a multiple of this (bounded compiles)
    c.trainer.length_bucket = 16  # micro-batches sorted by length, each padded to 16 * 2^k (0 = batch-wide padding)
    c.trainer.micro_batch_tokens = 0  # with length_bucket: 0 = micro_batch_size rows each; N = rows fitting N positions
    c.trainer.reuse_current_logps = True  # current-version rows: behaviour log-probs from the step's own forward
    # trainer | rollout (each slice scores its trajectories while idle) | sampler (the engine's own log-probs)
    c.trainer.behaviour_logps = "trainer"
    c.trainer.score_ahead = False  # True: behaviour log-probs of finished groups computed while the trainer waits
    c.trainer.grad_ahead = False  # True: gradients of the groups committed to the next batch computed while it waits
    c.trainer.dynamic_sampling = False  # DAPO: the coordinator trains only groups with reward variance, drawing more

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every_steps = 0  # 0 = no periodic checkpoints (SIGTERM still saves one)
    c.checkpoint.keep = 3  # newest checkpoints kept in WORKDIR/checkpoints

    c.eval = ml_collections.ConfigDict()
    c.eval.every_steps = 25  # evaluate the newest version at 0, every N steps and at the last step (0 = off)
    c.eval.num_prompts = 128  # held-out prompts (running_sums: draws training never makes)
    c.eval.samples = 4  # sampled responses per prompt: eval/pass@4; plus one greedy response each
    c.eval.path = ""  # an eval file (file tasks); "" = held out from the task's own source
    c.eval.final_timeout_s = 600.0  # the run waits this long for the last round

    c.log = ml_collections.ConfigDict()
    c.log.tensorboard = True  # write TensorBoard events under WORKDIR/tb
    c.log.wandb = False  # also log to Weights & Biases (pip install -e ".[wandb]")
    c.log.wandb_project = "dora_jax"
    c.log.wandb_name = ""  # "" = wandb's generated run name
    c.log.wandb_tags = ("smoke",)
    c.log.wandb_mode = "online"  # online | offline (no network; `wandb sync` later) | disabled
    c.lock()
    return c
