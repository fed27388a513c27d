"""The smoke run with a tiny Qwen3-MoE instead of the dense model, experts sharded in trainer and rollout.

    python -m dora_jax.train --config=configs/smoke_moe.py --workdir=/tmp/moe_smoke
    python -m dora_jax.audit /tmp/moe_smoke

Everything else is configs/smoke.py. The model: 2 layers, hidden 128, 8 experts of SwiGLU width
128 per layer, top-2 with renormalised weights (so the active MLP width, 256, equals the dense
smoke model's). The 8 fake CPU devices: a trainer slice expert 2 and 3 rollout slices expert 2.
The "dense" MoE computation (every expert on every token, gated) because it is the faster one on
CPU for this size (the grouped `ragged_dot` backward is slow there); on TPU use "grouped".
"""

import importlib.util
import os

import ml_collections


def get_config(arg=None):
    spec = importlib.util.spec_from_file_location("smoke", os.path.join(os.path.dirname(__file__), "smoke.py"))
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    c = smoke.get_config(arg)
    with c.unlocked():
        c.model.num_experts = 8  # experts per MoE layer (every layer is MoE)
        c.model.num_experts_per_tok = 2  # top-k
        c.model.moe_intermediate_size = 128  # each expert's SwiGLU width
        c.model.norm_topk_prob = True  # top-k weights sum to 1 (as Qwen3-30B-A3B)
        c.model.moe_dispatch = "dense"  # the faster computation on CPU at this size; same numbers as "grouped"
        c.mesh.trainer = ml_collections.ConfigDict({"expert": 2})  # experts split over the trainer's 2 devices
        c.mesh.rollout = ml_collections.ConfigDict({"expert": 2})  # and over each rollout slice's 2
        c.rollout.num_slices = 3  # 2 + 3 x 2 = 8 devices
        c.trainer.router_aux_coef = 0.0  # no load-balancing loss: the router trains only through the policy loss
    return c
