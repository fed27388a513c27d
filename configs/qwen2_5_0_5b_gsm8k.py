"""Qwen2.5-0.5B-Instruct on GSM8K, DORA, on one v5e-8 TPU VM (`v5litepod-8`: 8 chips, 16 GB each).

The whole system runs in one process on the host (`dora_jax.train`): a trainer slice of 4 chips
(FSDP) and 4 rollout slices of 1 chip each. You provide (set the `YOUR_...` fields, here or with
`--config.FIELD=VALUE`):
  - the checkpoint: a HF directory with config.json, *.safetensors, tokenizer.json (e.g.
    Qwen/Qwen2.5-0.5B-Instruct) at `pod.stage_model_from` (gs://); `setup` copies it to
    `model.hf_path` on the host. Already on the host: set pod.stage_model_from=''.
  - the prompts: GSM8K's train split as Parquet or JSONL with `question` and `answer` (the
    solution ending in `#### 72`) at `task.source.path` (local or gs://).
  - `pod.project` (and `pod.zone` if not us-west4-a).

    python launch/tpu.py create --config=configs/qwen2_5_0_5b_gsm8k.py     # --dry-run prints the gcloud commands
    python launch/tpu.py setup  --config=configs/qwen2_5_0_5b_gsm8k.py
    python launch/tpu.py run    --config=configs/qwen2_5_0_5b_gsm8k.py
    python launch/tpu.py logs   --config=configs/qwen2_5_0_5b_gsm8k.py
    python launch/tpu.py delete --config=configs/qwen2_5_0_5b_gsm8k.py

On a TPU VM you already have, with the checkpoint and data on it:
    python -m dora_jax.train --config=configs/qwen2_5_0_5b_gsm8k.py --workdir=/tmp/qwen05_gsm8k \
        --config.model.hf_path=/data/Qwen2.5-0.5B-Instruct --config.task.source.path=/data/gsm8k_train.parquet

Sizes: TBS 256 = 32 prompts x G 8; 4 x 96 = 384 decode slots = RBS, so every sample in flight
has a slot; K 2. KV cache: 24 layers x 2 KV heads x 64 x 2 (K, V) x 2 bytes = 12 KB/token, so
96 slots x 1024 tokens = 1.2 GB per rollout chip next to 1 GB of bf16 weights. Trainer: fp32
params + AdamW = 8 GB over 4 chips; a micro-batch of 8 rows keeps the 152K-vocab logits (0.6 GB
per 1K-token row in fp32) at 2 rows per chip.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    del arg
    c = ml_collections.ConfigDict()
    c.mode = "dora"  # sync | one_step_off | partial_rollout | dora
    c.num_steps = 200  # training steps (= versions published); ~1.7 epochs of GSM8K's 7.5K prompts
    c.seed = 0  # prompt order, sampling seeds
    c.compile_ahead = True  # every program compiled before the run starts: none compiles mid-run

    c.model = ml_collections.ConfigDict()
    c.model.hf_path = "models/Qwen2.5-0.5B-Instruct"  # HF checkpoint dir on the host (relative: to ~/dora_jax)
    # The fields below describe a fresh model; with hf_path set, config.json decides (values shown
    # are Qwen2.5-0.5B's, for reference).
    c.model.num_layers = 24  # decoder blocks
    c.model.hidden_size = 896  # embed width
    c.model.intermediate_size = 4864  # SwiGLU width
    c.model.num_heads = 14  # query heads
    c.model.num_kv_heads = 2  # key/value heads (GQA)
    c.model.head_dim = 64  # per-head width
    c.model.dtype = "bfloat16"  # compute dtype
    c.model.param_dtype = "float32"  # storage dtype of params (the trainer's master weights)
    c.model.attention = "auto"  # full-forward kernel: splash (Pallas) on TPU, cuDNN on GPU
    c.model.remat = "dots"  # the backward pass keeps the weight matmuls' outputs, recomputes the rest
    c.model.scan_layers = True  # the trainer's blocks as one lax.scan: XLA compiles one block, not every layer

    c.init = ml_collections.ConfigDict()
    c.init.checkpoint = ""  # a HF checkpoint to start RL from instead of model.hf_path; "" = model.hf_path
    c.init.sft_steps = 0  # no supervised cold start: the instruct model already answers
    c.init.sft_batch_size = 32  # (unused: sft_steps = 0)
    c.init.sft_lr = 1e-5  # (unused: sft_steps = 0)

    c.task = ml_collections.ConfigDict()
    c.task.kind = "gsm8k"  # numeric final-answer reward (the last \boxed{}, an Answer: line or #### N)
    c.task.fallback_last_number = False  # True: an answer-less response is graded by its last number
    c.task.reward_workers = 8  # reward processes on the host
    c.task.reward_timeout_s = 10.0  # per-sample reward timeout
    c.task.source = ml_collections.ConfigDict()
    c.task.source.path = "gs://YOUR_BUCKET/data/gsm8k/train-00000-of-00001.parquet"  # GSM8K train (Parquet/JSONL)
    c.task.source.format = "auto"  # auto | jsonl | parquet | hf_disk
    c.task.source.prompt_field = "question"  # the row field holding the question
    c.task.source.answer_field = "answer"  # the reference solution ending in "#### <number>"
    c.task.source.system_prompt = "Please reason step by step, and put your final answer within \\boxed{}."
    c.task.source.chat_template = True  # render with the tokenizer's chat template
    c.task.source.max_prompt_tokens = 256  # longer prompts are skipped (GSM8K's are ~100-200 tokens)
    c.task.source.shuffle = True  # a fresh seeded order every epoch
    c.task.source.max_bad_fraction = 0.01  # more unusable rows than this is an error (a wrong field name)

    c.mesh = ml_collections.ConfigDict()
    c.mesh.fake_cpu_devices = 0  # a TPU host: no fake CPU devices
    c.mesh.trainer = ml_collections.ConfigDict({"fsdp": 4})  # trainer slice: 4 chips, FSDP
    c.mesh.rollout = ml_collections.ConfigDict({"tensor": 1})  # each rollout slice: 1 chip
    c.mesh.time_shared = False  # 4 + 4 x 1 = 8 chips: disjoint slices

    c.rollout = ml_collections.ConfigDict()
    c.rollout.num_slices = 4  # rollout slices on the host
    c.rollout.slots = 96  # concurrent decodes per slice
    c.rollout.cache_length = 1024  # prompt + response tokens per slot
    c.rollout.max_prefill_length = 256  # largest prefill bucket (power of two) = task.source.max_prompt_tokens
    c.rollout.temperature = 1.0  # sampling temperature
    c.rollout.top_p = 1.0  # nucleus filter (1 = off)
    c.rollout.top_k = 0  # top-k filter (0 = off)
    c.rollout.max_new_tokens = 768  # response cap (GSM8K solutions: median ~250 tokens, long tail)
    # Paged KV cache: the 64-wide heads are packed two to a 128-lane row of the pool, so the ragged
    # paged attention kernel reads only live pages (tpu_compile, v5e: a decode step of 96 slots at
    # the mean length estimated at 6.2 ms against 26.3 with the dense cache; peak 2.43 GiB vs 5.45)
    c.rollout.page_size = 64
    c.rollout.kv_pages = 0  # pages in the pool (0 = sized by kv_memory_fraction; CPU: every slot full)
    c.rollout.kv_memory_fraction = 0.8  # the pool's share of chip memory left after the weights
    c.rollout.migration = "auto"  # a migrated request moves its KV or is re-prefilled, whichever costs less
    c.rollout.kv_link_bytes_per_s = 1.0e9  # slice to slice, bytes/s (assumed; measured moves replace it)
    c.rollout.min_prefill_bucket = 0  # smallest prefill bucket (0: the page size)

    c.coordinator = ml_collections.ConfigDict()
    c.coordinator.k_max = 2  # K: most versions a consumed trajectory may lag the trainer
    c.coordinator.group_size = 8  # G samples per prompt
    c.coordinator.train_batch_size = 256  # TBS samples per training step (32 prompts)
    c.coordinator.rollout_batch_size = 384  # RBS samples in flight (= the 384 decode slots)
    c.coordinator.rebalance_period_s = 2.0  # periodic orchestrator trigger
    # dora: new groups at an older version in that version's idle slots, only while the trainer can
    # still take them within K (coordinator/legacy_fill.py); off by default: with long tails its
    # deadline rarely admits a group (docs/performance.md)
    c.coordinator.legacy_fill = False
    # the loop applies finished results while a slice runs a command: a submit, a version load, a migration's
    # export or import (coordinator/port_calls.py); False: it waits, and a switch holds up the trainer
    c.coordinator.apply_results_during_calls = True

    c.trainer = ml_collections.ConfigDict()
    c.trainer.lr = 1e-6  # AdamW learning rate
    c.trainer.warmup_steps = 10  # linear warm-up updates
    c.trainer.weight_decay = 0.01  # AdamW weight decay
    c.trainer.clip_grad_norm = 1.0  # global-norm gradient clip
    c.trainer.eps_low = 0.2  # PPO clip below
    c.trainer.eps_high = 0.28  # PPO clip above (DAPO clip-higher)
    c.trainer.dual_clip = 3.0  # dual-clip bound for negative advantages
    c.trainer.tis_cap = 2.0  # truncated importance weight cap (0 = off)
    c.trainer.loss_norm = "token_mean"  # token_mean | seq_mean_token_mean | constant
    c.trainer.kl_coef = 0.0  # no KL to the initial policy
    c.trainer.advantage = "grpo"  # grpo | dr_grpo | rloo
    c.trainer.num_updates = 1  # optimizer updates per batch
    c.trainer.micro_batch_size = 8  # rows per forward/backward (2 per trainer chip)
    c.trainer.pad_to = 128  # sequence lengths are padded to a multiple of this (bounded compiles)
    c.trainer.length_bucket = 128  # rows sorted by length, each micro-batch padded to its own 128 x 2^k
    c.trainer.micro_batch_tokens = 8192  # token-budget micro-batches: 2K positions per chip (64 rows of 128, 8 of 1K)
    c.trainer.vocab_chunk = 8192  # log-probs over the 152K vocabulary 8K entries at a time
    c.trainer.behaviour_logps = "trainer"  # or "rollout": each slice scores its trajectories (docs/tpu_compile.md)
    c.trainer.score_ahead = False  # True: behaviour log-probs of finished groups computed while the trainer waits
    c.trainer.grad_ahead = False  # True: gradients of the groups committed to the next batch computed while it waits

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every_steps = 50  # periodic checkpoints into the workdir

    c.log = ml_collections.ConfigDict()
    c.log.tensorboard = True  # TensorBoard events under WORKDIR/tb

    c.pod = ml_collections.ConfigDict()  # launch/tpu.py: where and how to run on Cloud TPU
    c.pod.name = "dora-qwen05-gsm8k"  # TPU VM (and queued resource) name
    c.pod.project = "YOUR_GCP_PROJECT"  # GCP project id
    c.pod.zone = "us-west4-a"  # a zone that offers v5e (launch/tpu_types.py)
    c.pod.layout = "single_host"  # single_host | slices | multislice
    c.pod.trainer_type = "v5litepod-8"  # the host: 8 v5e chips
    c.pod.rollout_type = ""  # single_host: no rollout nodes (the chips are split by mesh.*)
    c.pod.runtime_version = ""  # TPU software version; "" = the generation's default (v2-alpha-tpuv5-lite)
    c.pod.provisioning = "spot"  # on_demand | spot | preemptible (plain VMs) | reserved (queued)
    c.pod.queued = True  # create through a queued resource (waits for capacity)
    c.pod.queued_together = True  # slices layouts: every node from one queued resource (one node here)
    c.pod.workdir = "runs/qwen2_5_0_5b_gsm8k"  # run directory on the host (relative: to ~/dora_jax)
    c.pod.port = 8470  # coordinator port (unused by single_host: the coordinator is in-process)
    c.pod.python = "3.12"  # Python of the uv environment setup makes on every worker (the images ship 3.10)
    c.pod.jax_tpu = "jax[tpu]==0.10.2"  # installed on every worker before the package
    c.pod.stage_model_from = "gs://YOUR_BUCKET/models/Qwen2.5-0.5B-Instruct"  # copied to model.hf_path at setup
    # Network and identity (docs/security.md): the nodes join this VPC network and subnetwork with no
    # public IP, under the tag `NAME-dora`; `create` opens the coordinator and transfer ports between
    # the run's tagged VMs only. Not "default": its default-allow-internal rule opens every port.
    c.pod.network = "dora-net"  # a VPC network without a broad allow-internal rule
    c.pod.subnetwork = "dora-subnet"  # its subnetwork in the zone's region, Private Google Access on
    c.pod.internal_ips = True  # no public IP (ssh through IAP; the subnet reaches GCS and PyPI via Cloud NAT)
    c.pod.service_account = "YOUR_SERVICE_ACCOUNT@YOUR_GCP_PROJECT.iam.gserviceaccount.com"  # the nodes' identity
    c.pod.tls = True  # coordinator over TLS with a per-run CA (False: plaintext inside the VPC)
    c.pod.transfer_port = 8480  # JAX transfer servers (weights, KV): this control port and the next (bulk)
    c.lock()
    return c
