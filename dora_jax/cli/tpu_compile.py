"""`python -m dora_jax.tpu_compile --config=configs/qwen2_5_7b_dapo.py --out=DIR [--target=pod|local|v5e:2x4]`

Compiles every program of each role ahead of time for the config's TPU topologies, on this
machine, without a TPU (dora_jax.runtime.aot): the trainer slice on `pod.trainer_type`, one
rollout slice on `pod.rollout_type` (a single-host pod splits its one node's chips). Writes
DIR/compile.json (per role: chips, HBM capacity, resident and peak bytes per chip, whether it
fits; per program: XLA's memory and cost figures and an estimated time), prints a table, and
exits 1 naming the program and the bytes when a role does not fit. `--target=local` compiles for
this machine's own devices (a TPU VM); `--target=v5e:2x2` for one host of that topology.
Needs libtpu for TPU topologies: pip install -e ".[tpu]".
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

from dora_jax import cli

OUT = flags.DEFINE_string("out", None, "directory for compile.json")
TARGET = flags.DEFINE_string(
    "target", "pod", "pod: the config's pod section; local: this machine's devices; or a topology such as v5e:2x4"
)
TRAIN_LENGTHS = flags.DEFINE_list(
    "train_lengths", [], "extra batch widths to compile the whole-batch train step for (the widest is always compiled)"
)
ESTIMATE_LENGTHS = flags.DEFINE_list(
    "estimate_lengths",
    None,
    "with model.scan_layers: trainer widths whose programs get cost estimates (probe compiles of 1 and "
    "2 unrolled blocks); default: the width nearest 4096",
)
ROLES = flags.DEFINE_list("roles", ["trainer", "rollout"], "roles to compile")


def main(argv):
    del argv
    if not OUT.value:
        raise app.UsageError("--out is required")
    unknown = set(ROLES.value) - {"trainer", "rollout"}
    if unknown:
        raise app.UsageError(f"--roles={','.join(ROLES.value)}: unknown {sorted(unknown)}; expected trainer, rollout")
    config_dict = cli.CONFIG.value
    if TARGET.value != "local":
        # The TPU compiler runs inside the CPU process: JAX must not look for TPU chips here.
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    cli.prepare_devices(config_dict)
    from dora_jax.runtime import aot, run_config

    path = os.path.join(OUT.value, "compile.json")

    def write(result: dict) -> None:  # after every role: a big model's roles take many minutes each
        os.makedirs(OUT.value, exist_ok=True)
        with open(path, "w") as f:
            json.dump({"config": cli.config_as_json(config_dict), **result}, f, indent=1)

    try:
        config = run_config.parse(config_dict)
        lengths = tuple(int(n) for n in TRAIN_LENGTHS.value)
        pod = config_dict.pod if "pod" in config_dict else None
        estimate = None if ESTIMATE_LENGTHS.value is None else [int(n) for n in ESTIMATE_LENGTHS.value]
        result = aot.compile_roles(
            config,
            pod,
            TARGET.value,
            train_lengths=lengths,
            estimate_lengths=estimate,
            roles=tuple(ROLES.value),
            on_role=write,
        )
    except (ValueError, RuntimeError) as err:
        print(f"tpu_compile: {err}", file=sys.stderr)
        sys.exit(2)
    write(result)
    print(aot.table(result))
    print(f"wrote {path}")
    problems = aot.does_not_fit(result)
    for line in problems:
        print(f"tpu_compile: {line}", file=sys.stderr)
    sys.exit(1 if problems else 0)


def run() -> None:
    """The `python -m dora_jax.tpu_compile` entry point."""
    app.run(main)


if __name__ == "__main__":
    run()
