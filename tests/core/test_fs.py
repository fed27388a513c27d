"""The file-system seam: the same operations on a local directory and on gs:// (a local GCS
emulator), and the errors of a gs:// path that cannot be used."""

import json

import pytest

from dora_jax.core import fs, object_log


def _exercise(root: str) -> None:
    """What a run does with its workdir, through the seam; the same answers wherever root is."""
    fs.makedirs(root)
    config = fs.join(root, "config.json")
    assert not fs.exists(config)
    with fs.open(config, "w") as f:
        json.dump({"mode": "dora"}, f)
    with fs.open(config) as f:
        assert json.load(f) == {"mode": "dora"}
    assert fs.exists(config) and not fs.isdir(config) and fs.size(config) == len('{"mode": "dora"}')
    # An atomic write is whole: until it closes, readers see the old content; one that raises
    # leaves the old content (a process polling the file never reads it empty or cut).
    with fs.open(config, "w", atomic=True) as f:
        f.write('{"mode": ')
        f.flush()
        assert json.loads(fs.read_bytes(config)) == {"mode": "dora"}
        f.write('"sync"}')
    with pytest.raises(RuntimeError), fs.open(config, "w", atomic=True) as f:
        f.write('{"mo')
        raise RuntimeError("the writer failed mid-file")
    with fs.open(config) as f:
        assert json.load(f) == {"mode": "sync"}
    with fs.open(config, "w") as f:
        json.dump({"mode": "dora"}, f)

    rows = fs.join(root, "metrics.jsonl")
    with fs.open(rows, "a") as f:
        f.write('{"step": 0}\n')
        f.flush(wait=False)
        f.write('{"step": 1}\n')
    with fs.open(rows, "a") as f:  # reopened, as a resumed run does
        f.write('{"step": 2}\n')
        f.flush()
        assert fs.read_bytes(rows).count(b"\n") == 3  # stored while still open
    assert fs.read_bytes(rows) == b'{"step": 0}\n{"step": 1}\n{"step": 2}\n'
    assert fs.read_bytes(rows, start=12) == b'{"step": 1}\n{"step": 2}\n'
    assert b"".join(fs.read_blocks(rows, 3)) == fs.read_bytes(rows)[3:]
    fs.truncate(rows, 24)
    with fs.open(rows) as f:
        assert f.readlines() == ['{"step": 0}\n', '{"step": 1}\n']

    fs.makedirs(fs.join(root, "tb"))
    with fs.open(fs.join(root, "tb", "events.bin"), "ab") as f:
        f.write(b"\x00\x01")
    assert fs.read_bytes(fs.join(root, "tb", "events.bin")) == b"\x00\x01"
    assert fs.listdir(root) == ["config.json", "metrics.jsonl", "tb"]
    assert fs.isdir(fs.join(root, "tb")) and fs.isdir(root)
    fs.remove(config)
    assert not fs.exists(config) and fs.listdir(root) == ["metrics.jsonl", "tb"]
    with pytest.raises(FileNotFoundError):
        fs.read_bytes(config)


def test_local_paths_are_plain_files(tmp_path):
    root = str(tmp_path / "run")
    _exercise(root)
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"step": 0}\n{"step": 1}\n'
    assert fs.read_bytes("file://" + root + "/metrics.jsonl") == b'{"step": 0}\n{"step": 1}\n'


def test_the_same_operations_on_gcs(gcs_root):
    _exercise(gcs_root)
    # A finished appended file is one object (gcloud storage cat, TensorBoard read it as is).
    gcs = fs._fs(gcs_root)
    assert gcs.cat_file(fs.join(gcs_root, "metrics.jsonl")) == b'{"step": 0}\n{"step": 1}\n'
    assert not gcs.exists(object_log.chunk_dir(fs.join(gcs_root, "metrics.jsonl")))


def test_directories_copy_between_local_disk_and_gcs(gcs_root, tmp_path):
    local = tmp_path / "sft"
    (local / "sub").mkdir(parents=True)
    (local / "model.safetensors").write_bytes(b"weights")
    (local / "sub" / "config.json").write_text("{}")
    fs.copy_dir(str(local), fs.join(gcs_root, "sft"))
    assert fs.listdir(fs.join(gcs_root, "sft")) == ["model.safetensors", "sub"]
    back = tmp_path / "back"
    fs.copy_dir(fs.join(gcs_root, "sft"), str(back))
    assert (back / "model.safetensors").read_bytes() == b"weights"
    assert (back / "sub" / "config.json").read_text() == "{}"


def test_a_missing_bucket_fails_at_start_naming_the_path_and_how_to_authenticate(gcs_emulator):
    path = "gs://no-such-bucket/run"
    with pytest.raises(fs.StorageError) as caught:
        fs.makedirs(path)
    message = str(caught.value)
    assert path in message and "gcloud storage buckets create gs://no-such-bucket" in message
    assert "gcloud auth application-default login" in message and "service account" in message
    assert not fs.exists("gs://no-such-bucket")  # checked, not created (epath's mkdir would create it)
    with pytest.raises(fs.StorageError, match="no bucket in the path"):
        fs.check_access("gs:///run")


def test_no_credentials_fail_at_start_naming_the_path_and_how_to_authenticate(monkeypatch, tmp_path):
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)  # the real GCS: credentials are checked first
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "no-key.json"))
    with pytest.raises(fs.StorageError) as caught:
        fs.check_access("gs://some-bucket/run")
    message = str(caught.value)
    assert message.startswith("gs://some-bucket/run: no Google Cloud credentials found")
    assert "gcloud auth application-default login" in message and "GOOGLE_APPLICATION_CREDENTIALS" in message


def test_local_paths_need_no_check_and_bad_modes_are_refused(tmp_path):
    fs.check_access(str(tmp_path))  # nothing to check
    with pytest.raises(ValueError, match="mode 'r\\+'"):
        fs.open(str(tmp_path / "x"), "r+")
