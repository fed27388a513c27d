"""notebooks/quickstart.ipynb: committed without outputs, and run end to end on the CPU.

The run executes the notebook in a fresh IPython kernel (nbclient), with the `parameters`-tagged
cell replaced by a short run (papermill's convention), and checks what it shows: the curves and
the timeline as images, the audit table with no violation, one evaluation trajectory.
"""

import json
import os
import pathlib
import re

import pytest

from dora_jax.coordinator.audit import audit
from dora_jax.coordinator.ledger import read_ledger

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
VIOLATION_ROWS = ("C1", "C2", "C3", "exactly-once", "weights")
# tests/helpers.tiny_config's model, batches and no SFT (tests/test_cold_start.py covers it): fewer,
# smaller programs to compile, and the same ones as the other end-to-end tests, with which the kernel
# shares the session's persistent compilation cache (tests/conftest.py).
TINY = {
    "model.hidden_size": 64,
    "model.intermediate_size": 128,
    "model.head_dim": 16,
    "rollout.slots": 4,
    "rollout.cache_length": 128,
    "rollout.max_prefill_length": 64,
    "rollout.max_new_tokens": 40,
    "task.k_max": 20,
    "coordinator.train_batch_size": 8,
    "coordinator.rollout_batch_size": 16,
    "trainer.micro_batch_size": 8,
}


def _cells():
    return json.loads(NOTEBOOK.read_text())["cells"]


def test_quickstart_notebook_is_committed_clean():
    cells = _cells()
    code = [c for c in cells if c["cell_type"] == "code"]
    assert all(not c["outputs"] and c["execution_count"] is None for c in code), "clear the notebook's outputs"
    tagged = [c for c in code if "parameters" in c["metadata"].get("tags", [])]
    assert len(tagged) == 1, "exactly one cell tagged `parameters`"
    source = "".join(tagged[0]["source"])
    names = (
        "STEPS",
        "MODE",
        "EVAL_EVERY",
        "EVAL_PROMPTS",
        "EVAL_SAMPLES",
        "SFT_STEPS",
        "WORKDIR",
        "RUNTIME",
        "OVERRIDES",
    )
    for name in names:
        assert re.search(rf"^{name} = ", source, re.M), f"{name} is not set in the parameters cell"
    assert "".join(code[0]["source"]).startswith("# "), "the install cell opens with its comment"
    assert 'REPO_URL = "' in "".join(code[0]["source"])


def _kernel_env() -> dict:
    """This process's environment for the kernel, less its device count: the notebook's own
    `prepare_devices` sets XLA_FLAGS from the config, as it does on Colab."""
    env = dict(os.environ)
    flags = [f for f in env.pop("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("MPLBACKEND", None)  # the kernel's own (inline) backend
    return env


def _text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif "data" in out:
            parts.append(out["data"].get("text/plain", ""))
    return "".join(parts)


@pytest.mark.slow
def test_quickstart_notebook_runs_on_cpu(tmp_path):
    import nbclient  # the test extra installs these: the run never skips
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    (params,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    params.source = "\n".join(
        [
            "STEPS = 4",
            'MODE = "dora"',
            "EVAL_EVERY = 2",
            "EVAL_PROMPTS = 4",
            "EVAL_SAMPLES = 2",
            "SFT_STEPS = 0",
            f"WORKDIR = {str(tmp_path)!r}",
            'RUNTIME = "cpu"',
            f"OVERRIDES = {TINY!r}",
        ]
    )
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute(env=_kernel_env())  # raises CellExecutionError, with the cell and traceback, if a cell fails

    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    assert "installing dora_jax" not in _text(code[0])  # importable here: no pip, no network
    devices = next(_text(c) for c in code if "JAX devices" in _text(c))
    assert "runtime cpu: 8 JAX devices" in devices, devices

    images = [c for c in code if any("image/png" in o.get("data", {}) for o in c.outputs)]
    assert len(images) == 2, "the curves and the timeline"
    assert "eval/reward_greedy" in "".join(images[0].source)
    assert "write_timeline" in "".join(images[1].source)

    table = next(_text(c) for c in code if "exactly-once" in _text(c))
    for name in VIOLATION_ROWS:
        assert re.search(rf"^{re.escape(name)}\b.*\s0$", table, re.M), f"{name} row not 0:\n{table}"
    assert re.search(r"^audit ok\s+True$", table, re.M), table

    sample = next(_text(c) for c in code if "response:" in _text(c))
    assert re.search(r"^prompt: ", sample, re.M) and re.search(r"^reward: ", sample, re.M), sample

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "eval/reward_greedy" in r]
    assert sorted(r["step"] for r in evals) == [0, 2, 4]
    assert len([r for r in rows if "reward_mean" in r]) == 4
    assert (tmp_path / "timeline.png").stat().st_size > 0
    config = json.loads((tmp_path / "config.json").read_text())  # the parameters reached the run's config
    assert (config["num_steps"], config["mode"], config["init"]["sft_steps"]) == (4, "dora", 0)
    assert (config["eval"]["every_steps"], config["eval"]["num_prompts"], config["eval"]["samples"]) == (2, 4, 2)
    assert config["model"]["hidden_size"] == 64 and config["mesh"]["fake_cpu_devices"] == 8

    # The dora end-to-end run of the suite (tests/test_train_smoke.py runs the other modes): the
    # tiny config's invariants, from the ledger, evaluation included.
    events = list(read_ledger(str(tmp_path / "ledger.jsonl")))
    report = audit(events)
    assert report.ok and report.consumed == 4 * 8 and report.max_staleness <= 2, report.summary()
    assert report.eval_dispatched == report.eval_finished == 3 * 4 * (1 + 2)
    assert not [e for e in events if e["ev"] == "interrupt"] and not report.c1_violations
    last = [r for r in rows if "reward_mean" in r][-1]
    for key in ("tokens_per_s", "staleness_max", "versions_in_flight", "trainer_wait_s", "bubble_ratio"):
        assert key in last, key
