"""The metrics writer's rows, its Weights & Biases mirror and the reward-curve plot drawn from the rows."""

import glob
import json
import os
import struct
import sys
import threading
import time
import zlib

import matplotlib.axes
import pytest

from dora_jax.runtime.metrics import MetricsWriter, WandbSpec, plot_reward_curve, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_reward_curve_png_from_metrics(tmp_path):
    writer = MetricsWriter(str(tmp_path), tensorboard=False)
    for step, reward in enumerate([0.1, 0.2, float("nan"), 0.4]):
        writer.write(step, {"reward_mean": reward, "loss": 0.5})
    writer.close()
    rows = read_metrics(str(tmp_path))
    assert [r["reward_mean"] for r in rows] == [0.1, 0.2, None, 0.4]  # non-finite -> null
    path = plot_reward_curve(str(tmp_path))
    assert path == str(tmp_path / "reward_curve.png")
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC


def test_no_rewards_no_plot(tmp_path):
    MetricsWriter(str(tmp_path), tensorboard=False).close()
    assert plot_reward_curve(str(tmp_path)) is None


def _spy_on_axes(monkeypatch) -> dict:
    """Records the labels of the curves drawn and the title set by the plots that follow."""
    drawn = {"labels": [], "titles": []}
    plot, set_title = matplotlib.axes.Axes.plot, matplotlib.axes.Axes.set_title

    def spy_plot(self, *args, **kwargs):
        drawn["labels"].append((kwargs.get("label"), [list(a) for a in args]))
        return plot(self, *args, **kwargs)

    def spy_set_title(self, label, *args, **kwargs):
        drawn["titles"].append(label)
        return set_title(self, label, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy_plot)
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", spy_set_title)
    return drawn


def test_reward_curve_with_eval_rows_out_of_order(tmp_path, monkeypatch):
    writer = MetricsWriter(str(tmp_path), tensorboard=False)
    for step, reward in enumerate([0.1, 0.2, 0.3]):
        writer.write(step, {"reward_mean": reward, "loss": 0.5})
    # Evaluation rows come from another thread, after later training steps: only step + eval/ keys.
    writer.write(0, {"eval/reward_greedy": 0.25, "eval/pass@4": 0.5, "eval/pass@16": 0.75})
    writer.write(3, {"reward_mean": 0.4, "loss": 0.5})
    writer.write(4, {"reward_mean": 0.5, "loss": 0.5})
    writer.write(2, {"eval/reward_greedy": 0.5, "eval/pass@4": 0.625, "eval/pass@16": float("nan")})
    writer.close()

    rows = read_metrics(str(tmp_path))
    assert rows[3] == {"step": 0, "eval/reward_greedy": 0.25, "eval/pass@4": 0.5, "eval/pass@16": 0.75}
    assert rows[6] == {"step": 2, "eval/reward_greedy": 0.5, "eval/pass@4": 0.625, "eval/pass@16": None}
    assert [r["step"] for r in rows if "reward_mean" in r] == [0, 1, 2, 3, 4]

    drawn = _spy_on_axes(monkeypatch)
    path = plot_reward_curve(str(tmp_path), filename="curve.png")
    assert path == str(tmp_path / "curve.png")
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    curves = dict(drawn["labels"])
    assert curves["reward_mean per step"] == [[0, 1, 2, 3, 4], [0.1, 0.2, 0.3, 0.4, 0.5]]
    assert curves["eval greedy reward (held-out)"] == [[0, 2], [0.25, 0.5]]
    assert curves["eval pass@4"] == [[0, 2], [0.5, 0.625]]
    assert curves["eval pass@16"] == [[0], [0.75]]  # the NaN point is left out
    assert [label for label, _ in drawn["labels"]][-2:] == ["eval pass@4", "eval pass@16"]  # by K, not by name
    (title,) = drawn["titles"]
    assert title.endswith(": first 3 steps 0.200, last 3 0.400, eval greedy 0.250 -> 0.500")


def test_reward_curve_from_eval_rows_only(tmp_path, monkeypatch):
    writer = MetricsWriter(str(tmp_path), tensorboard=False)
    writer.write(0, {"eval/reward_greedy": 0.25})
    writer.write(5, {"eval/reward_greedy": 0.75})
    writer.close()
    drawn = _spy_on_axes(monkeypatch)
    path = plot_reward_curve(str(tmp_path))
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    assert [label for label, _ in drawn["labels"]] == ["eval greedy reward (held-out)"]
    assert drawn["titles"][0].endswith(": eval greedy 0.250 -> 0.750")


def test_writes_from_two_threads_keep_whole_rows(tmp_path):
    writer = MetricsWriter(str(tmp_path), tensorboard=False)

    def rows(prefix):
        for step in range(300):
            writer.write(step, {f"{prefix}/a": step * 0.5, f"{prefix}/b": "x" * 200})

    threads = [threading.Thread(target=rows, args=(p,)) for p in ("train", "eval")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writer.close()
    writer.close()  # idempotent
    got = read_metrics(str(tmp_path))
    assert len(got) == 600
    for prefix in ("train", "eval"):
        assert [r["step"] for r in got if f"{prefix}/a" in r] == list(range(300))


def test_rows_tensorboard_events_and_the_curve_on_gcs(gcs_root):
    """On gs:// (a local GCS emulator): the rows, TensorBoard's event file (whole TFRecords, one
    object once closed) and the reward curve go through dora_jax.core.fs."""
    from dora_jax.core import fs

    writer = MetricsWriter(gcs_root, tensorboard=True)
    for step in range(3):
        writer.write(step, {"reward_mean": 0.25 * step}, histograms={"lengths": [1, 2, 3]})
    writer.close()
    assert [r["reward_mean"] for r in read_metrics(gcs_root)] == [0.0, 0.25, 0.5]
    (events,) = fs.listdir(fs.join(gcs_root, "tb"))
    data, records = fs.read_bytes(fs.join(gcs_root, "tb", events)), 0
    while data:  # TFRecord framing: u64 length, u32 crc, payload, u32 crc
        (length,) = struct.unpack("<Q", data[:8])
        data, records = data[12 + length + 4 :], records + 1
    assert records >= 1 + 3 * 2  # the file version, then a scalar and a histogram per step
    assert plot_reward_curve(gcs_root) == fs.join(gcs_root, "reward_curve.png")
    assert fs.read_bytes(fs.join(gcs_root, "reward_curve.png")).startswith(PNG_MAGIC)


def test_bad_wandb_mode():
    with pytest.raises(ValueError, match=r"log\.wandb_mode='shared'.*'online', 'offline', 'disabled'"):
        WandbSpec(mode="shared")


def test_missing_wandb_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ImportError, match=r'pip install wandb.*pip install -e "\.\[wandb\]"'):
        MetricsWriter(str(tmp_path), tensorboard=False, wandb=WandbSpec(mode="offline"))
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def _wandb_records(path):
    """The records of a run's transaction log (run-ID.wandb): a 7-byte header (":W&B", 0xBEE1, version 0),
    then LevelDB-log chunks in 32 KiB blocks, each chunk 7 bytes (CRC-32 of type+data, length, type:
    1 full, 2 first, 3 middle, 4 last) and its data. wandb 0.31 has no Python reader for it any more
    (the old wandb.sdk.internal.datastore is gone: wandb-core, in Go, writes and reads it). A chunk still
    being written ends the records."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:7] == b":W&B" + struct.pack("<HB", 0xBEE1, 0)
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is zero padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # preallocated zeros at the end
            break
        if pos + 7 + length > len(data):
            break
        chunk = data[pos + 7 : pos + 7 + length]
        assert crc == zlib.crc32(chunk, zlib.crc32(bytes([kind]))), f"bad checksum at byte {pos}"
        pos += 7 + length
        pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _finished_records(path, timeout_s=15.0):
    """The records once the log ends with the run's exit record. wandb 0.31's `run.finish()` can return
    before wandb-core has written the log out (seen here: the header alone right after the first run of a
    process finished, the whole log some 50 ms later), so this polls."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = _wandb_records(path)
        if records and records[-1].WhichOneof("record_type") == "exit":
            return records
        assert time.monotonic() < deadline, f"{path}: no exit record after {timeout_s} s ({len(records)} records)"
        time.sleep(0.05)


def _history_rows(records):
    """Each `run.log` call's values, without W&B's own `_step`/`_runtime`/`_timestamp`; values nested
    under a key (an image's fields) as "key.field"."""
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {(item.key or ".".join(item.nested_key)): json.loads(item.value_json) for item in record.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def test_wandb_offline_run_holds_the_logged_scalars(tmp_path, monkeypatch):
    import wandb  # noqa: F401  (the test extra installs it: this test never skips)

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "offline")  # belt and braces: never the network
    workdir = str(tmp_path)
    spec = WandbSpec(project="dora_test", name="t", tags=("a",), mode="offline")
    writer = MetricsWriter(workdir, tensorboard=False, wandb=spec, config={"lr": 0.001, "model": "tiny"})
    writer.write(0, {"reward_mean": 0.125, "loss": 0.5, "note": "text is not a scalar"})
    writer.write(1, {"reward_mean": float("nan"), "loss": 0.25})
    writer.write(2, {"reward_mean": 0.375, "loss": 0.125})
    # A second writer's run while the first is active: its own run, not the first one returned again.
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    other = MetricsWriter(str(other_dir), tensorboard=False, wandb=WandbSpec(project="dora_test", mode="offline"))
    other.write(7, {"reward_mean": 0.875})
    writer.write(1, {"eval/reward_greedy": 0.625, "eval/pass@4": 0.75})  # after training step 2
    other.close()
    curve = plot_reward_curve(workdir)
    writer.close(images={"reward_curve": curve, "absent": str(tmp_path / "absent.png")})
    writer.close()  # idempotent

    (run_dir,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    (log_file,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    records = _finished_records(log_file)
    assert records[0].WhichOneof("record_type") == "header"

    rows = _history_rows(records)
    assert rows[:4] == [
        {"step": 0, "reward_mean": 0.125, "loss": 0.5},
        {"step": 1, "loss": 0.25},  # the NaN reward is not logged
        {"step": 2, "reward_mean": 0.375, "loss": 0.125},
        {"step": 1, "eval/reward_greedy": 0.625, "eval/pass@4": 0.75},
    ]
    (image_row,) = rows[4:]
    assert image_row["step"] == 2  # the images sit at the last step written
    assert image_row["reward_curve._type"] == "image-file"
    assert not any(k.startswith("absent") for k in image_row)
    assert os.path.isfile(os.path.join(run_dir, "files", image_row["reward_curve.path"]))

    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name, list(run.tags)) == ("dora_test", "t", ["a"])
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["lr"] == 0.001 and config["model"] == "tiny"
    metrics = [r.metric for r in records if r.WhichOneof("record_type") == "metric"]
    assert any(m.glob_name == "*" and m.step_metric == "step" for m in metrics)

    (other_run_dir,) = glob.glob(str(other_dir / "wandb" / "offline-run-*"))
    (other_log,) = glob.glob(os.path.join(other_run_dir, "run-*.wandb"))
    assert _history_rows(_finished_records(other_log)) == [{"step": 7, "reward_mean": 0.875}]
