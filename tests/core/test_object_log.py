"""Append-only files on GCS (a local emulator): chunks composed as they pile up, read back exactly,
crash leftovers never read twice, a reader unharmed by a compose under it."""

import threading

from dora_jax.core import fs, object_log


def _chunks(gcs, path):
    return sorted(object_log._list_chunks(gcs, path))


def test_every_flush_is_read_back_in_order_and_chunks_are_composed(gcs_root):
    gcs, path = fs._fs(gcs_root), fs.join(gcs_root, "ledger.jsonl")
    writer = object_log.Appender(gcs, path, min_interval_s=0.0)
    expected = b""
    for i in range(2 * object_log.COMPOSE_MAX + 5):
        line = f'{{"ev": "dispatch", "i": {i}}}\n'.encode()
        writer.write(line)
        writer.flush(wait=True)  # one chunk each
        expected += line
        assert b"".join(object_log.read_blocks(gcs, path)) == expected
    assert len(_chunks(gcs, path)) < object_log.COMPOSE_MAX  # composed twice on the way
    assert _chunks(gcs, path)[0] == (0, 2 * object_log.COMPOSE_MAX - 2)  # 32 chunks, then 1 + 31
    writer.close()
    assert _chunks(gcs, path) == [] and gcs.cat_file(path) == expected


def test_crash_leftovers_are_read_once_and_cleared_by_the_next_writer(gcs_root):
    gcs, path = fs._fs(gcs_root), fs.join(gcs_root, "ledger.jsonl")
    name = lambda first, last: f"{object_log.chunk_dir(path)}/{first:010d}-{last:010d}"
    # A writer composed chunks 0..1 into 0-1 and died before deleting them; it also wrote 2.
    gcs.pipe_file(name(0, 0), b"a\n")
    gcs.pipe_file(name(1, 1), b"b\n")
    gcs.pipe_file(name(0, 1), b"a\nb\n")
    gcs.pipe_file(name(2, 2), b"c\n")
    assert fs.read_bytes(path) == b"a\nb\nc\n" and fs.size(path) == 6
    with fs.open(path, "a") as writer:  # the resumed run
        assert _chunks(gcs, path) == [(0, 1), (2, 2)]
        writer.write("d\n")
    assert fs.read_bytes(path) == b"a\nb\nc\nd\n" and _chunks(gcs, path) == []
    # A close that died after deleting its first chunk: the object is the whole file.
    gcs.pipe_file(name(5, 5), b"stale\n")
    assert fs.read_bytes(path) == b"a\nb\nc\nd\n"
    with fs.open(path, "a") as writer:
        writer.write("e\n")
    assert fs.read_bytes(path) == b"a\nb\nc\nd\ne\n" and _chunks(gcs, path) == []


def test_a_reader_goes_on_from_its_offset_when_chunks_are_composed_under_it(gcs_root):
    gcs, path = fs._fs(gcs_root), fs.join(gcs_root, "ledger.jsonl")
    writer = object_log.Appender(gcs, path, min_interval_s=0.0)
    for i in range(10):
        writer.write(f"{i}\n")
        writer.flush()
    blocks = object_log.read_blocks(gcs, path)
    first = next(blocks)  # chunk 0 read; now every chunk is composed away
    writer.close()
    assert first + b"".join(blocks) == b"".join(f"{i}\n".encode() for i in range(10))


def test_flushes_without_waiting_are_coalesced_off_the_writers_thread(gcs_root):
    gcs, path = fs._fs(gcs_root), fs.join(gcs_root, "metrics.jsonl")
    writer = object_log.Appender(gcs, path, min_interval_s=3600.0)
    writer.write("0\n")
    writer.flush()  # the first upload is due at once
    threads = [threading.Thread(target=lambda i=i: (writer.write(f"{i}\n"), writer.flush(wait=False))) for i in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(_chunks(gcs, path)) == 1  # the others wait for the interval (or for a waiting flush)
    writer.flush()
    assert len(_chunks(gcs, path)) == 2 and sorted(fs.read_bytes(path).split()) == [b"0", b"1", b"2"]
    writer.close()
