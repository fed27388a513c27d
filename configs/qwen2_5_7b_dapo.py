"""Qwen2.5-7B on DAPO-Math-17k, DORA, on a v5p-64's worth of chips split into separate slices.

Layout `slices` (launch/pod.py): a trainer slice `v5p-32` (16 chips on 4 hosts, FSDP over all 16)
and 4 rollout slices `v5p-8` (4 chips on 1 host each, tensor-parallel 4): 32 v5p chips, each
slice its own TPU VM and its own JAX job. The coordinator (gRPC) runs on worker 0 of the trainer
slice; versions travel through the ParamStore's tensorstore tier under `pod.workdir` (gs://).
You provide (set the `YOUR_...` fields, here or with `--config.FIELD=VALUE`):
  - the checkpoint: a HF directory (config.json, *.safetensors, tokenizer.json) of Qwen/Qwen2.5-7B
    (or -Instruct) at `pod.stage_model_from`; `setup` copies it to `model.hf_path` on every worker.
  - the prompts: DAPO-Math-17k as Parquet (BytedTsinghua-SIA/DAPO-Math-17k: `prompt` is a chat
    message list that asks for a final `Answer: ...` line, `reward_model.ground_truth` the answer)
    at `task.source.path` (gs:// or local on every worker).
  - `pod.project`, and `pod.workdir` in a bucket the TPU VMs' service account can write.

    python launch/tpu.py create --config=configs/qwen2_5_7b_dapo.py     # ONE queued resource, 5 nodes (--dry-run)
    python launch/tpu.py status --config=configs/qwen2_5_7b_dapo.py     # wait until all are ACTIVE
    python launch/tpu.py setup  --config=configs/qwen2_5_7b_dapo.py
    python launch/tpu.py run    --config=configs/qwen2_5_7b_dapo.py
    python launch/tpu.py logs   --config=configs/qwen2_5_7b_dapo.py
    python -m dora_jax.audit gs://YOUR_BUCKET/dora/qwen2_5_7b_dapo    # when it is done
    python launch/tpu.py delete --config=configs/qwen2_5_7b_dapo.py

Sizes: G 16 (DAPO's), TBS 512 = 32 prompts x 16, RBS 1024 = 4 slices x 256 slots, K 2; two
optimizer updates per batch (DAPO's mini-batches). Responses up to 8K tokens (DAPO trains with
up to 20K; raise rollout.max_new_tokens and cache_length together if the tail is cut, and
task.overlong_penalty_tokens to 20% of the new cap). The DAPO knobs are in docs/dapo.md. Rollout
KV: 28 layers x 4 KV heads x 128 x 2 (K, V) x 2 bytes = 57 KB/token; 256 slots x 9216 tokens =
134 GB per slice next to 15 GB of bf16 weights, out of 4 x 95 GB. Trainer: 7.6B params x 16 bytes
(fp32 params, AdamW moments, grads) = 122 GB over 16 chips; micro-batches hold 4K positions per
chip (128 rows of 512 ... 16 rows of 4K; one 8K or 9K row per chip), the blocks run under one
scan and keep their weight matmuls' outputs for the backward pass (`remat = "dots"`). Compiled
for these chips with `python -m dora_jax.tpu_compile` (docs/tpu_compile.md).
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    del arg
    c = ml_collections.ConfigDict()
    c.mode = "dora"  # sync | one_step_off | partial_rollout | dora
    c.num_steps = 300  # training steps (= versions published): 9.6K prompts at 32 per step
    c.seed = 0  # prompt order, sampling seeds
    c.compile_ahead = True  # every program compiled before the run starts: none compiles mid-run

    c.model = ml_collections.ConfigDict()
    c.model.hf_path = "models/Qwen2.5-7B"  # HF checkpoint dir on every worker (relative: to ~/dora_jax)
    # The fields below describe a fresh model; with hf_path set, config.json decides (values shown
    # are Qwen2.5-7B's, for reference).
    c.model.num_layers = 28  # decoder blocks
    c.model.hidden_size = 3584  # embed width
    c.model.intermediate_size = 18944  # SwiGLU width
    c.model.num_heads = 28  # query heads
    c.model.num_kv_heads = 4  # key/value heads (GQA)
    c.model.head_dim = 128  # per-head width
    c.model.dtype = "bfloat16"  # compute dtype
    c.model.param_dtype = "float32"  # storage dtype of params (the trainer's master weights)
    c.model.attention = "auto"  # full-forward kernel: splash (Pallas) on TPU, cuDNN on GPU
    c.model.remat = "dots"  # the backward pass keeps the weight matmuls' outputs, recomputes the rest
    c.model.scan_layers = True  # the trainer's blocks as one lax.scan: XLA compiles one block, not every layer

    c.init = ml_collections.ConfigDict()
    c.init.checkpoint = ""  # a HF checkpoint to start RL from instead of model.hf_path; "" = model.hf_path
    c.init.sft_steps = 0  # no supervised cold start
    c.init.sft_batch_size = 32  # (unused: sft_steps = 0)
    c.init.sft_lr = 1e-5  # (unused: sft_steps = 0)

    c.task = ml_collections.ConfigDict()
    c.task.kind = "math"  # LaTeX / symbolic answers checked by math-verify
    c.task.fallback_last_number = False  # DAPO-Math asks for an "Answer:" line; none stated scores 0
    c.task.reward_workers = 32  # reward processes (a v5p host has 208 vCPUs)
    c.task.reward_timeout_s = 10.0  # per-sample reward timeout (math-verify can hang on odd LaTeX)
    # A grade that times out or raises scores 0 and stays in the loss (as verl scores a timeout), so a
    # response that hangs the grader is not left unpunished; "mask" would drop it from the loss.
    c.task.reward_on_error = 0.0
    # DAPO's soft overlong punishment: a linear penalty from 0 to -1 over the last L_cache tokens before
    # the response cap. The paper uses L_cache = 4096 of L_max = 20480 (20%); scaled to this config's
    # rollout.max_new_tokens = 8192: 0.2 x 8192 = 1638 (responses past 6554 tokens are penalised).
    c.task.overlong_penalty_tokens = 1638
    c.task.source = ml_collections.ConfigDict()
    c.task.source.path = "gs://YOUR_BUCKET/data/dapo-math-17k.parquet"  # DAPO-Math-17k (Parquet)
    c.task.source.format = "parquet"  # auto | jsonl | parquet | hf_disk
    c.task.source.prompt_field = "prompt"  # a chat message list (its user turn carries the instructions)
    c.task.source.answer_field = "reward_model.ground_truth"  # the reference answer
    c.task.source.id_field = "extra_info.index"  # a stable row id for the ledger
    c.task.source.chat_template = True  # render with the tokenizer's chat template
    c.task.source.max_prompt_tokens = 1024  # longer prompts are skipped
    c.task.source.shuffle = True  # a fresh seeded order every epoch
    c.task.source.max_bad_fraction = 0.01  # more unusable rows than this is an error (a wrong field name)

    c.mesh = ml_collections.ConfigDict()
    c.mesh.fake_cpu_devices = 0  # TPU: no fake CPU devices
    c.mesh.trainer = ml_collections.ConfigDict({"fsdp": 16})  # the trainer slice: all 16 chips of the v5p-32
    c.mesh.rollout = ml_collections.ConfigDict({"tensor": 4})  # each rollout slice: the 4 chips of a v5p-8
    c.mesh.time_shared = False  # separate slices

    c.rollout = ml_collections.ConfigDict()
    c.rollout.num_slices = 4  # rollout slices (= rollout TPU VMs)
    c.rollout.slots = 256  # concurrent decodes per slice
    c.rollout.cache_length = 9216  # prompt + response tokens per slot
    c.rollout.max_prefill_length = 1024  # largest prefill bucket (power of two) = task.source.max_prompt_tokens
    c.rollout.temperature = 1.0  # sampling temperature (DAPO's)
    c.rollout.top_p = 1.0  # nucleus filter (1 = off)
    c.rollout.top_k = 0  # top-k filter (0 = off)
    c.rollout.max_new_tokens = 8192  # response cap
    c.rollout.weights_transfer = False  # True: versions device to device (one-host trainer only; this one has 4)
    c.rollout.page_size = 64  # paged KV cache: rows per page (the TPU kernel reads 16 pages per block)
    c.rollout.kv_pages = 0  # pages in the pool (0 = sized by kv_memory_fraction; CPU: every slot full)
    c.rollout.kv_memory_fraction = 0.8  # the pool's share of chip memory left after the weights
    c.rollout.migration = "auto"  # a migrated request moves its KV or is re-prefilled, whichever costs less
    c.rollout.kv_link_bytes_per_s = 1.0e9  # slice to slice, bytes/s (assumed; measured moves replace it)
    c.rollout.min_prefill_bucket = 0  # smallest prefill bucket (0: the page size): 64, 128, ..., 1024

    c.coordinator = ml_collections.ConfigDict()
    c.coordinator.k_max = 2  # K: most versions a consumed trajectory may lag the trainer
    c.coordinator.group_size = 16  # G samples per prompt
    c.coordinator.train_batch_size = 512  # TBS samples per training step (32 prompts)
    c.coordinator.rollout_batch_size = 1024  # RBS samples in flight (= 4 x 256 slots)
    c.coordinator.rebalance_period_s = 5.0  # periodic orchestrator trigger
    # dora: new groups at an older version in that version's idle slots, only while the trainer can
    # still take them within K (coordinator/legacy_fill.py); off by default: with long tails its
    # deadline rarely admits a group (docs/performance.md)
    c.coordinator.legacy_fill = False
    # the loop applies finished results while a slice runs a command: a submit, a version load, a migration's
    # export or import (coordinator/port_calls.py); False: it waits, and a switch holds up the trainer
    c.coordinator.apply_results_during_calls = True
    # dynamic sampling: most batches' worth of groups filtered between two takes before the run stops as
    # saturated (verl's DAPO recipe: max_num_gen_batches=10; 0: no limit)
    c.coordinator.max_filtered_batches_per_step = 10

    c.trainer = ml_collections.ConfigDict()
    c.trainer.lr = 1e-6  # AdamW learning rate (DAPO's)
    c.trainer.warmup_steps = 10  # linear warm-up updates
    c.trainer.weight_decay = 0.1  # AdamW weight decay (DAPO's)
    c.trainer.clip_grad_norm = 1.0  # global-norm gradient clip
    c.trainer.eps_low = 0.2  # PPO clip below (DAPO's eps_low)
    c.trainer.eps_high = 0.28  # PPO clip above: DAPO's clip-higher (eps_high 0.28 > eps_low 0.2)
    c.trainer.dual_clip = 3.0  # dual-clip bound for negative advantages
    c.trainer.tis_cap = 2.0  # truncated importance weight cap (0 = off)
    c.trainer.loss_norm = "token_mean"  # DAPO's token-level loss: every token of the batch weighs alike
    c.trainer.overlong_filter = True  # DAPO: responses cut at max_new_tokens are masked from the loss
    c.trainer.kl_coef = 0.0  # no KL (DAPO drops it)
    c.trainer.advantage = "grpo"  # grpo | dr_grpo | rloo
    c.trainer.dynamic_sampling = True  # DAPO: the coordinator trains only groups with reward variance, drawing more
    c.trainer.num_updates = 2  # optimizer updates per batch (mini-batches of 256)
    c.trainer.micro_batch_size = 16  # rows per forward/backward (one per trainer chip)
    c.trainer.pad_to = 512  # sequence lengths are padded to a multiple of this (bounded compiles)
    c.trainer.length_bucket = 512  # rows sorted by length, each micro-batch padded to its own 512 x 2^k
    c.trainer.micro_batch_tokens = 65536  # token budget: 4K positions per chip (128 rows of 512, 16 of 4K)
    c.trainer.vocab_chunk = 8192  # log-probs over the 152K vocabulary 8K entries at a time
    c.trainer.behaviour_logps = "trainer"  # or "rollout": each slice scores its trajectories (docs/tpu_compile.md)
    c.trainer.score_ahead = False  # True: behaviour log-probs of finished groups computed while the trainer waits
    c.trainer.grad_ahead = False  # True: gradients of the groups committed to the next batch computed while it waits

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every_steps = 25  # periodic checkpoints into the workdir (spot VMs get preempted)

    c.log = ml_collections.ConfigDict()
    c.log.tensorboard = True  # TensorBoard events under WORKDIR/tb

    c.pod = ml_collections.ConfigDict()  # launch/tpu.py: where and how to run on Cloud TPU
    c.pod.name = "dora-qwen7b-dapo"  # nodes: NAME-trainer, NAME-rollout-0 ... NAME-rollout-3
    c.pod.project = "YOUR_GCP_PROJECT"  # GCP project id
    c.pod.zone = "us-east5-a"  # a zone that offers v5p (launch/tpu_types.py)
    c.pod.layout = "slices"  # single_host | slices | multislice
    c.pod.trainer_type = "v5p-32"  # trainer slice: 16 chips, 4 hosts (= mesh.trainer)
    c.pod.rollout_type = "v5p-8"  # each rollout slice: 4 chips, 1 host (= mesh.rollout)
    c.pod.runtime_version = ""  # TPU software version; "" = the generation's default (v2-alpha-tpuv5)
    c.pod.provisioning = "spot"  # on_demand | spot | preemptible (plain VMs) | reserved (queued)
    c.pod.queued = True  # create through queued resources (waits for capacity)
    c.pod.queued_together = True  # slices: every node from ONE queued resource, all or nothing (False: one each)
    c.pod.workdir = "gs://YOUR_BUCKET/dora/qwen2_5_7b_dapo"  # shared run directory and param versions
    c.pod.port = 8470  # coordinator port on worker 0 of the trainer slice
    c.pod.python = "3.12"  # Python of the uv environment setup makes on every worker (the images ship 3.10)
    c.pod.jax_tpu = "jax[tpu]==0.10.2"  # installed on every worker before the package
    c.pod.stage_model_from = "gs://YOUR_BUCKET/models/Qwen2.5-7B"  # copied to model.hf_path at setup
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
