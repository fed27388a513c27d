"""`python -m dora_jax.bench {engine,modes,convergence,weights} --config=... --out=DIR`: benchmarks that
write JSON (and PNGs); ratios are measured side by side in one process run."""

from __future__ import annotations

import os

from absl import app

from dora_jax import cli


def main(argv):
    if len(argv) != 2 or argv[1] not in ("engine", "modes", "convergence", "weights"):
        raise app.UsageError(
            "usage: python -m dora_jax.bench {engine,modes,convergence,weights} --config=FILE --out=DIR"
        )
    if not cli.OUT.value:
        raise app.UsageError("--out is required")
    config = cli.CONFIG.value
    cli.prepare_devices(config)
    os.makedirs(cli.OUT.value, exist_ok=True)
    match argv[1]:
        case "engine":
            from dora_jax.bench.engine import format_table, run_engine_bench
            from dora_jax.bench.modes import engine_bench_config

            results = run_engine_bench(engine_bench_config(config), cli.OUT.value)
            print(format_table(results))
        case "modes":
            from dora_jax.bench import modes as bench_modes

            bench_modes.main(config, cli.OUT.value)
        case "convergence":
            from dora_jax.bench import convergence as bench_convergence

            bench_convergence.main(config, cli.OUT.value)
        case "weights":
            from dora_jax.bench import weights as bench_weights
            from dora_jax.runtime import run_config

            print(bench_weights.format_table(bench_weights.main(run_config.parse(config), cli.OUT.value)))


if __name__ == "__main__":
    app.run(main)
