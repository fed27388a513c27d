"""`python -m dora_jax.sim --config=configs/sim_paper.py --out=DIR`: simulate every mode, write
DIR/results.json and print a table. `--calibrate` instead fits the cost model to the paper's
synchronous rows and prints the constants to put in the config.

`--compile=DIR1/compile.json --compile=DIR2/compile.json` (repeated, or comma-separated) projects
instead the real config those `python -m dora_jax.tpu_compile` outputs were compiled from: its pod,
batch and costs from XLA's estimates (dora_jax/sim/projection.py); results.json is labelled a
projection, and has no paper comparison and no sweep."""

from absl import app, flags
from ml_collections import config_flags

from dora_jax.sim.calibrate import print_calibration
from dora_jax.sim.projection import project
from dora_jax.sim.report import format_table, run_all, run_projection
from dora_jax.sim.runs import default_jobs
from dora_jax.sim.scenario import from_config

_CONFIG = config_flags.DEFINE_config_file("config", None, "simulator config file", lock_config=True)
_OUT = flags.DEFINE_string("out", None, "output directory for results.json")
_LEDGER = flags.DEFINE_bool("ledger", False, "also write each run's event ledger (JSON lines)")
_SWEEP = flags.DEFINE_bool("sweep", True, "run the scaling sweep")
_JOBS = flags.DEFINE_integer(
    "jobs", 0, "worker processes for the independent simulated runs (0: one per core this process may use)"
)
_CALIBRATE = flags.DEFINE_bool("calibrate", False, "fit the cost model to the paper's sync rows")
_COMPILE = flags.DEFINE_multi_string(
    "compile", [], "tpu_compile's compile.json of a real config (repeat, or comma-separate): project that config"
)


def main(argv):
    del argv
    compiled = [path for value in _COMPILE.value for path in value.split(",") if path]
    if _CALIBRATE.value and compiled:
        raise app.UsageError("--calibrate fits the paper scenario; it does not apply to --compile")
    if _CALIBRATE.value:
        print_calibration(from_config(_CONFIG.value))
        return
    if not _OUT.value:
        raise app.UsageError("--out=DIR is required")
    if _JOBS.value < 0:
        raise app.UsageError(f"--jobs={_JOBS.value}; expected >= 0 (0: one per core)")
    jobs = _JOBS.value or default_jobs()
    if compiled:
        results = run_projection(project(_CONFIG.value, compiled), _OUT.value, ledger=_LEDGER.value, jobs=jobs)
    else:
        results = run_all(from_config(_CONFIG.value), _OUT.value, ledger=_LEDGER.value, sweep=_SWEEP.value, jobs=jobs)
    print(format_table(results))
    print("\nnotes:\n- " + "\n- ".join(results["notes"]))
    print(f"\nwrote {_OUT.value}/results.json")


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    app.run(main)
