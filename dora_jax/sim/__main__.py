"""`python -m dora_jax.sim --config=configs/sim_paper.py --out=DIR`: simulate every mode, write
DIR/results.json and print a table. `--calibrate` instead fits the cost model to the paper's
synchronous rows and prints the constants to put in the config."""

from absl import app, flags
from ml_collections import config_flags

from dora_jax.sim.calibrate import print_calibration
from dora_jax.sim.report import format_table, run_all
from dora_jax.sim.scenario import from_config

_CONFIG = config_flags.DEFINE_config_file("config", None, "simulator config file", lock_config=True)
_OUT = flags.DEFINE_string("out", None, "output directory for results.json")
_LEDGER = flags.DEFINE_bool("ledger", False, "also write each run's event ledger (JSON lines)")
_SWEEP = flags.DEFINE_bool("sweep", True, "run the scaling sweep")
_CALIBRATE = flags.DEFINE_bool("calibrate", False, "fit the cost model to the paper's sync rows")


def main(argv):
    del argv
    scenario = from_config(_CONFIG.value)
    if _CALIBRATE.value:
        print_calibration(scenario)
        return
    if not _OUT.value:
        raise app.UsageError("--out=DIR is required")
    results = run_all(scenario, _OUT.value, ledger=_LEDGER.value, sweep=_SWEEP.value)
    print(format_table(results))
    print("\nnotes:\n- " + "\n- ".join(results["notes"]))
    print(f"\nwrote {_OUT.value}/results.json")


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    app.run(main)
