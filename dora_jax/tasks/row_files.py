"""Row tables read from prompt files: JSON lines, Parquet, and HF `datasets` saved to disk.

A `RowTable` gives random access to rows as dicts, so a source can visit them in any order
without materialising every row as Python objects (DAPO-Math-17k's parquet holds 1.8M rows).
A row that cannot be read (a non-JSON line) raises `BadRow`; a file that cannot be read at all,
or lacks a column the config names, raises at open time with the file and the column named.

Paths: a local path, or a URL read through dora_jax.core.fs (`gs://bucket/a.jsonl` through
gcsfs, a core dependency; `file:///tmp/a.parquet`; whatever else fsspec reads). HF `datasets`
directories are opened by `datasets.load_from_disk`, which reads remote URLs through fsspec too.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

from dora_jax.core import fs

FORMATS = ("jsonl", "parquet", "hf_disk")


class BadRow(Exception):
    """A row to skip; `reason` is the short counter key (e.g. "invalid JSON")."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclasses.dataclass(frozen=True)
class RowTable:
    """`num_rows` rows; `row(i)` returns row i as a dict or raises `BadRow`."""

    path: str
    num_rows: int
    row: Callable[[int], dict]
    columns: tuple[str, ...]  # column names (for JSON lines: the first row's keys), for errors


def infer_format(path: str) -> str:
    """'jsonl' for .jsonl/.json, 'parquet' for .parquet, 'hf_disk' for a directory."""
    name = path.rstrip("/").lower()
    if name.endswith((".jsonl", ".json", ".jsonl.txt")):
        return "jsonl"
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    if "://" not in path and os.path.isdir(path):
        return "hf_disk"
    raise ValueError(f"{path}: cannot tell the format from the name; set SourceConfig.format to one of {FORMATS}")


def read_bytes(path: str) -> bytes:
    """The whole file: local paths and URLs (gs://, file://, ...) through dora_jax.core.fs."""
    if not fs.is_remote(path) and not os.path.isfile(path.removeprefix("file://")):
        raise FileNotFoundError(f"{path}: no such file")
    fs.check_access(path)
    try:
        return fs.read_bytes(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None


def open_rows(path: str, file_format: str, needed_columns: tuple[str, ...], split: str = "train") -> RowTable:
    """Opens `path` as `file_format` ('auto' infers it); checks `needed_columns` where the format
    has a schema (Parquet, HF datasets)."""
    if file_format == "auto":
        file_format = infer_format(path)
    if file_format == "jsonl":
        return _jsonl_rows(path)
    if file_format == "parquet":
        return _parquet_rows(path, needed_columns)
    if file_format == "hf_disk":
        return _hf_disk_rows(path, needed_columns, split)
    raise ValueError(f"SourceConfig.format={file_format!r}: must be 'auto' or one of {FORMATS}")


def _jsonl_rows(path: str) -> RowTable:
    lines = [line for line in read_bytes(path).splitlines() if line.strip()]

    def row(index: int) -> dict:
        try:
            value = json.loads(lines[index])
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise BadRow("invalid JSON", str(err)) from None
        if not isinstance(value, dict):
            raise BadRow("not a JSON object", type(value).__name__)
        return value

    columns: tuple[str, ...] = ()
    if lines:
        try:
            columns = tuple(row(0))
        except BadRow:
            pass
    return RowTable(path, len(lines), row, columns)


def _check_columns(path: str, columns: tuple[str, ...], needed: tuple[str, ...]) -> None:
    for name in needed:
        if name not in columns:
            raise ValueError(
                f"{path}: no column {name!r} (named by the SourceConfig field mapping); columns are {list(columns)}"
            )


def _parquet_rows(path: str, needed_columns: tuple[str, ...]) -> RowTable:
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{path}: reading Parquet needs pyarrow: pip install pyarrow") from None
    if "://" not in path and not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    source: Any = path if "://" not in path else pyarrow.BufferReader(read_bytes(path))
    try:
        table = pq.read_table(source)
    except pyarrow.ArrowInvalid as err:
        raise ValueError(f"{path}: not a readable Parquet file: {err}") from None
    columns = tuple(table.column_names)
    _check_columns(path, columns, needed_columns)
    # Only the mapped columns are read per row; each is a ChunkedArray indexed lazily.
    arrays = {name: table.column(name) for name in dict.fromkeys(needed_columns)}
    return RowTable(path, table.num_rows, lambda i: {n: a[i].as_py() for n, a in arrays.items()}, columns)


def _hf_disk_rows(path: str, needed_columns: tuple[str, ...], split: str) -> RowTable:
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"{path}: reading a HF dataset saved to disk needs the datasets package: pip install datasets"
        ) from None
    dataset = datasets.load_from_disk(path)
    if isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            raise ValueError(f"{path}: no split {split!r} (SourceConfig.split); splits are {list(dataset)}")
        dataset = dataset[split]
    columns = tuple(dataset.column_names)
    _check_columns(path, columns, needed_columns)
    dataset = dataset.select_columns(list(dict.fromkeys(needed_columns)))
    return RowTable(path, len(dataset), lambda i: dataset[int(i)], columns)
