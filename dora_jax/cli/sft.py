"""`python -m dora_jax.sft --config=configs/smoke_sft.py --workdir=DIR`: the supervised cold start.

Trains a fresh tiny model on correct running-sums demonstrations and writes the HF checkpoint
DIR/sft, which an RL run starts from with `--config.init.checkpoint=DIR/sft` (the smoke RL run
does this by itself, cached in its workdir, when no checkpoint is given).
"""

from __future__ import annotations

import json

from absl import app

from dora_jax import cli
from dora_jax.core import fs


def main(argv):
    del argv
    cli.prepare_devices(cli.CONFIG.value)
    from dora_jax.runtime import run_config
    from dora_jax.runtime.build import fresh_model_config, make_tokenizer
    from dora_jax.runtime.cold_start import cold_start

    config = run_config.parse(cli.CONFIG.value)
    workdir = cli.WORKDIR.value
    fs.makedirs(workdir)
    tokenizer = make_tokenizer(config)
    model = cold_start(config, fresh_model_config(config, tokenizer.vocab_size, tokenizer.eos_ids), tokenizer, workdir)
    print(json.dumps({"checkpoint": fs.join(workdir, "sft"), "params": model.config.hidden_size}))


def run() -> None:
    """The `python -m dora_jax.sft` entry point."""
    app.run(main)


if __name__ == "__main__":
    run()
