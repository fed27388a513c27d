"""`python -m dora_jax.generate --hf_path=DIR --prompt_ids=1,2,3 --max_new_tokens=N --temperature=0`

Loads a HF checkpoint onto a rollout mesh, generates one response through the rollout engine and
worker (the same path RL rollout uses), and prints one JSON line last:
`{"token_ids": [generated ids only], "logprobs": [...], "text": str | null, "finish_reason": str}`.
`--prompt="text"` instead of `--prompt_ids` needs DIR/tokenizer.json. Log-probs are the model's
log-probs of the generated tokens at --temperature (1 when greedy), before top-k/top-p (see
dora_jax.rollout.sampling).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import jax

from dora_jax.core.records import Request, SamplingParams
from dora_jax.models import read_config
from dora_jax.models.tokenizer import HFTokenizer
from dora_jax.parallel import sharding
from dora_jax.rollout.engine import EngineConfig, RolloutEngine
from dora_jax.rollout.worker import RolloutWorker


def _power_of_two_at_least(n: int, floor: int = 16) -> int:
    size = floor
    while size < n:
        size *= 2
    return size


def generate(
    hf_path: str,
    *,
    prompt_ids: Sequence[int] | None = None,
    prompt: str | None = None,
    max_new_tokens: int = 32,
    sampling: SamplingParams = SamplingParams(temperature=0.0),
    tensor_parallel: int = 1,
) -> dict:
    """One response from the checkpoint at `hf_path`; returns the dict `main` prints."""
    tokenizer = HFTokenizer(hf_path) if os.path.exists(os.path.join(hf_path, "tokenizer.json")) else None
    if (prompt_ids is None) == (prompt is None):
        raise ValueError("pass exactly one of --prompt_ids or --prompt")
    if prompt is not None:
        if tokenizer is None:
            raise ValueError(f"--prompt needs {hf_path}/tokenizer.json; pass --prompt_ids instead")
        prompt_ids = tokenizer.encode(prompt)
    prompt_ids = tuple(int(t) for t in prompt_ids)
    model_config = read_config(hf_path)
    config = EngineConfig(
        num_slots=1,
        max_prefill_length=_power_of_two_at_least(len(prompt_ids)),
        cache_length=_power_of_two_at_least(len(prompt_ids) + max_new_tokens),
    )
    mesh = sharding.make_mesh(jax.devices()[:tensor_parallel], {"tensor": tensor_parallel})
    engine = RolloutEngine(model_config, config, mesh, tokenizer=tokenizer)
    eos_ids = model_config.eos_ids or (tokenizer.eos_ids if tokenizer is not None else ())
    worker = RolloutWorker(engine, eos_ids=eos_ids)
    worker.load_version(0, engine.load_params(hf_path=hf_path))
    worker.submit(Request("generate", "generate", "generate", prompt_ids, 0, max_new_tokens, sampling))
    finished = []
    while worker.has_work:
        finished += worker.step()
    (trajectory,) = finished
    if trajectory.error:
        raise ValueError(trajectory.error)
    return {
        "token_ids": list(trajectory.response_ids),
        "logprobs": [round(x, 6) for x in trajectory.logprobs],
        "text": tokenizer.decode(trajectory.response_ids) if tokenizer is not None else None,
        "finish_reason": trajectory.finish_reason.value,
    }


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m dora_jax.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--hf_path", required=True, help="HF checkpoint directory (config.json + safetensors)")
    parser.add_argument("--prompt_ids", default=None, help="comma-separated prompt token ids, e.g. 1,2,3")
    parser.add_argument("--prompt", default=None, help="prompt text (needs tokenizer.json in --hf_path)")
    parser.add_argument("--max_new_tokens", type=int, default=32, help="response length cap")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus filter (1 = off)")
    parser.add_argument("--top_k", type=int, default=0, help="top-k filter (0 = off)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--tensor_parallel", type=int, default=1, help="local devices to shard the model over")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    prompt_ids = None if args.prompt_ids is None else [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    result = generate(
        args.hf_path,
        prompt_ids=prompt_ids,
        prompt=args.prompt,
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        tensor_parallel=args.tensor_parallel,
    )
    print(json.dumps(result), flush=True)
    return 0


def run() -> None:
    """The `python -m dora_jax.generate` entry point."""
    sys.exit(main())


if __name__ == "__main__":
    run()
