"""Qwen3-30B-A3B (MoE: 128 experts, 8 per token, 3B active) on DAPO-Math-17k, DORA, on 32 v5p chips.

Layout `slices` (launch/pod.py): a trainer slice `v5p-32` (16 chips on 4 hosts: FSDP 4 x expert
parallel 4) and 4 rollout slices `v5p-8` (4 chips on 1 host each: tensor 4), each its
own TPU VM and JAX job; the coordinator (gRPC) on worker 0 of the trainer slice; versions through
the ParamStore's tensorstore tier under `pod.workdir` (gs://). The MoE fields (experts, top-k,
expert width, routing normalisation) come from the checkpoint's config.json.
You provide (set the `YOUR_...` fields, here or with `--config.FIELD=VALUE`):
  - the checkpoint: Qwen/Qwen3-30B-A3B (or -Base) as a HF directory (config.json, *.safetensors,
    tokenizer.json) at `pod.stage_model_from`; `setup` copies its 61 GB to `model.hf_path` on
    every worker (a v5p VM's boot disk holds it; give the VMs a bigger disk for more).
  - the prompts: DAPO-Math-17k as Parquet at `task.source.path` (see configs/qwen2_5_7b_dapo.py).
  - `pod.project`, and `pod.workdir` in a bucket the TPU VMs' service account can write.

    python launch/tpu.py create --config=configs/qwen3_30b_a3b.py     # ONE queued resource, 5 nodes (--dry-run)
    python launch/tpu.py status --config=configs/qwen3_30b_a3b.py
    python launch/tpu.py setup  --config=configs/qwen3_30b_a3b.py
    python launch/tpu.py run    --config=configs/qwen3_30b_a3b.py
    python launch/tpu.py logs   --config=configs/qwen3_30b_a3b.py
    python launch/tpu.py delete --config=configs/qwen3_30b_a3b.py

Sizes: G 16, TBS 256 = 16 prompts x 16, RBS 512 = 4 slices x 128 slots, K 2. Rollout: bf16
weights 61 GB / 4 chips = 15 GB per chip; KV 48 layers x 4 KV heads x 128 x 2 (K, V) x 2 bytes =
98 KB/token, a quarter per chip (tensor 4); a paged pool (64-row pages) sized at 0.8 of the memory
left after the weights, capped at 128 slots x 9216 tokens = 29 GB per chip. Tensor 4, not tensor 2 x
expert 2: with the experts split over an `expert` axis every decode step all-gathered them (XLA's
count for one layer's step: 1.74 GB per chip, against 0.94 GB with each expert's width split over
4 chips; tpu_compile of a 1- and a 2-layer model, measured before the experts' expert parallelism
in the megablox kernels, which keeps the experts split and gathers the tokens instead).
Trainer: 30.5B params x 12 bytes (fp32 params, AdamW moments) + a bf16 version = 28.65 GiB per
chip over 16; rows over fsdp x expert (one per chip at least), token-budget micro-batches of 32K
positions (64 rows of 512; rows of 4K and longer one per chip), expert parallelism in the megablox
kernels. `python -m dora_jax.tpu_compile` (docs/tpu_compile.md): peak 76.86 of 95 GiB
per chip (`grad[rows=16,T=9216]`); both roles compile in 18 min on a 2-core machine. The router stays as trained
(no auxiliary load-balancing loss), as RL fine-tuning recipes do. Everything not set here (task,
loss, optimizer, pod zone and types, K) is configs/qwen2_5_7b_dapo.py's.
"""

import importlib.util
import os

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    spec = importlib.util.spec_from_file_location("dapo", os.path.join(os.path.dirname(__file__), "qwen2_5_7b_dapo.py"))
    dapo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dapo)
    c = dapo.get_config(arg)
    with c.unlocked():
        c.model.hf_path = "models/Qwen3-30B-A3B"  # HF checkpoint dir on every worker (relative: to ~/dora_jax)
        c.model.num_layers = 48  # decoder blocks (every one MoE); the MoE fields come from config.json
        c.model.hidden_size = 2048  # embed width
        c.model.intermediate_size = 6144  # dense SwiGLU width (unused: every layer is MoE, 768 wide per expert)
        c.model.num_heads = 32  # query heads
        # expert parallelism, every expert projection in the megablox kernels (dora_jax.models.moe):
        # with "grouped" the TPU compiler expands the weight gradients densely over all 128 experts
        # (XLA's estimate for one 32K-token micro-batch: 3,941 TFLOP per chip, 8.6 s)
        c.model.moe_dispatch = "megablox"
        c.mesh.trainer = ml_collections.ConfigDict({"fsdp": 4, "expert": 4})  # the 16 chips of the v5p-32
        c.mesh.rollout = ml_collections.ConfigDict({"tensor": 4})  # the 4 chips of a v5p-8 (experts' width split)
        c.rollout.slots = 128  # concurrent decodes per slice
        c.coordinator.train_batch_size = 256  # TBS samples per training step (16 prompts)
        c.coordinator.rollout_batch_size = 512  # RBS samples in flight (= 4 x 128 slots)
        # rows per forward/backward: one per chip, so that the expert-parallel chips take rows too
        # (batch over fsdp x expert; with 8 rows each expert group would compute the same 8)
        c.trainer.micro_batch_size = 16
        # token budget: 2K positions per chip (64 rows of 512; 4K rows and longer take one per chip);
        # the 7B's 65536 needed 53 GiB of temporaries here (tpu_compile, before expert parallelism)
        c.trainer.micro_batch_tokens = 32768
        # micro-batches of 1K positions and up (1024 x 2^k, then 9216): a row of 512 or fewer (a
        # reasoning model's prompt plus a short answer: rare) pays for 1024, and the trainer compiles
        # 5 gradient and 5 recompute programs instead of 6 and 6 (82 s less of tpu_compile here)
        c.trainer.pad_to = 1024
        c.trainer.length_bucket = 1024
        # prefill buckets 256, 512, 1024: the decode weights dominate a short prefill (tpu_compile:
        # prefill[T=64] 15.3 ms, [T=128] 16.2 ms, [T=256] 18.2 ms), and 2 fewer prefill programs of
        # 48 MoE layers compile (110 s here). A slot's KV rows move in buckets from 256 rows too
        # (insert / read_slot: 4 fewer programs; a migrated prefix under 256 rows moves 256)
        c.rollout.min_prefill_bucket = 256
        c.pod.name = "dora-qwen3-30b-a3b"  # nodes: NAME-trainer, NAME-rollout-0 ... NAME-rollout-3
        c.pod.workdir = "gs://YOUR_BUCKET/dora/qwen3_30b_a3b"  # shared run directory and param versions
        c.pod.stage_model_from = "gs://YOUR_BUCKET/models/Qwen3-30B-A3B"  # copied to model.hf_path at setup
    c.lock()
    return c
