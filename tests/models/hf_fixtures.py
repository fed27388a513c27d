"""Tiny random HF checkpoints made with transformers, for reference checks (torch CPU)."""

from __future__ import annotations

import torch
import transformers

VOCAB = 128


def llama_config():
    """Llama 3.x shape: GQA (4 q heads over 2 kv heads), llama3 rope scaling, untied head."""
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_scaling={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )


def qwen2_config():
    """Qwen2: q/k/v biases, tied embeddings."""
    return transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        eos_token_id=2,
    )


def qwen3_config():
    """Qwen3: q/k RMSNorm, head_dim (24) != hidden / heads (16)."""
    return transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=24,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=2,
    )


CONFIGS = {"llama": llama_config, "qwen2": qwen2_config, "qwen3": qwen3_config}


def make_checkpoint(kind: str, path, seed: int = 0):
    """Saves a random model of `kind` to `path` and returns the torch model (eval mode, fp32)."""
    torch.manual_seed(seed)
    config = CONFIGS[kind]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # non-trivial biases and norm scales so that the map is really checked
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.eval()
    model.save_pretrained(str(path))
    return model


def hf_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()
