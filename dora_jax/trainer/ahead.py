"""Behaviour log-probs computed ahead: while the trainer waits for its batch (the version window is
closed, or too few groups have finished), it computes the behaviour log-probs of the finished
groups the coordinator will hand it (`trainer.score_ahead`); when the batch arrives, those rows are
not recomputed on the step's critical path.

Each row is kept under its trajectory id with its generating version, the positions it uses and
its tokens there: a row of the batch takes the stored log-probs only when all three match (a row
packed to another width keeps its positions; anything else is recomputed, as without this). Each
version's params digest goes with the rows it computed, for the step's behaviour digests. Rows the
trainer never takes (a resumed coordinator's, a group taken in a later batch that never comes)
leave oldest first once `capacity` rows are held.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Any

import numpy as np

from dora_jax.core.records import TrainBatch
from dora_jax.trainer.bucketed import row_lengths


@dataclasses.dataclass(frozen=True)
class _Row:
    version: int
    tokens_key: bytes  # blake2b of the row's tokens over its positions
    logps_L: np.ndarray  # [L]: the behaviour log-probs over the row's positions
    digest: str  # of the params that computed them


def _tokens_key(tokens_L: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(tokens_L, np.int32).tobytes(), digest_size=16).digest()


class AheadLogps:
    """The rows computed ahead, by trajectory id (see the module docstring)."""

    def __init__(self, capacity: int = 4096):
        self._rows: collections.OrderedDict[str, _Row] = collections.OrderedDict()
        self._capacity = capacity

    def __len__(self) -> int:
        return len(self._rows)

    def wanted(self, batch: TrainBatch) -> np.ndarray:
        """[B] bool: real rows not computed ahead yet."""
        return np.asarray([bool(t) and t not in self._rows for t in batch.traj_ids], bool)

    def store(self, batch: TrainBatch, logps_BT: np.ndarray, rows_B: np.ndarray, digests: dict[int, str]) -> None:
        """Keeps `logps_BT`'s `rows_B` rows; `digests`: version -> digest of the params used."""
        lengths_B, tokens_BT = row_lengths(batch), np.asarray(batch.tokens_BT)
        for b in np.flatnonzero(rows_B):
            version, length = int(batch.versions_B[b]), int(lengths_B[b])
            self._rows[batch.traj_ids[b]] = _Row(
                version,
                _tokens_key(tokens_BT[b, :length]),
                np.array(logps_BT[b, :length], np.float32),
                digests[version],
            )
        while len(self._rows) > self._capacity:
            self._rows.popitem(last=False)

    def apply(self, batch: TrainBatch, open_B: np.ndarray) -> tuple[TrainBatch, np.ndarray, dict[int, str]]:
        """Fills the `open_B` rows (those without log-probs that came with the batch) that were
        computed ahead: (the batch with them in `behaviour_logps_BT`, [B] bool of those rows, the
        digests of the versions that computed them). The batch's rows are forgotten, used or not
        (a row the step's own forward gives is not used), as no later batch holds them."""
        found_B = np.zeros(batch.batch_size, bool)
        if not self._rows:
            return batch, found_B, {}
        lengths_B, tokens_BT = row_lengths(batch), np.asarray(batch.tokens_BT)
        behaviour_BT = (
            np.zeros(tokens_BT.shape, np.float32)
            if batch.behaviour_logps_BT is None
            else np.array(batch.behaviour_logps_BT, np.float32)
        )
        digests = {}
        for b in np.flatnonzero(open_B):
            row = self._rows.get(batch.traj_ids[b])
            length = int(lengths_B[b])
            if (
                row is None
                or row.version != int(batch.versions_B[b])
                or row.logps_L.size != length
                or row.tokens_key != _tokens_key(tokens_BT[b, :length])
            ):
                continue
            behaviour_BT[b] = 0.0
            behaviour_BT[b, :length] = row.logps_L
            found_B[b] = True
            digests[row.version] = row.digest
        for traj_id in batch.traj_ids:
            self._rows.pop(traj_id, None)
        if not found_B.any():
            return batch, found_B, {}
        return dataclasses.replace(batch, behaviour_logps_BT=behaviour_BT), found_B, digests


@dataclasses.dataclass
class HeldGrads:
    """`trainer.grad_ahead`: gradient sums the trainer computed at `version`'s params, while it
    waited, for the rows of whole groups the coordinator committed to its next batch
    (Coordinator.peek_batch with `committed`). `keys`: trajectory id -> `row_key` of each row they
    cover; the step uses them only if it is still at `version` and its batch holds every one of
    those rows with the same key (else they are dropped and the step computes those rows itself).
    `digests`: version -> digest of the params that computed behaviour log-probs for them;
    `recomputed`: how many of their rows had theirs recomputed."""

    version: int
    partial: Any  # dora_jax.trainer.bucketed.Partial
    keys: dict[str, bytes]
    digests: dict[int, str]
    recomputed: int

    def rows_in(self, batch: TrainBatch) -> np.ndarray | None:
        """[B] bool: `batch`'s rows these sums cover, if the batch holds every one of them with the
        same key (the same tokens, masks, log-probs, reward, validity, version and group); None
        otherwise."""
        index = {t: b for b, t in enumerate(batch.traj_ids) if t}
        if any(t not in index for t in self.keys):
            return None
        rows_B = np.zeros(batch.batch_size, bool)
        rows_B[[index[t] for t in self.keys]] = True
        if row_keys(batch, rows_B) != self.keys:
            return None
        return rows_B


def row_keys(batch: TrainBatch, rows_B: np.ndarray) -> dict[str, bytes]:
    """trajectory id -> a digest of everything a row's gradient depends on besides the params and
    the batch-level weight factor: its version, tokens, loss mask, inference log-probs, behaviour
    log-probs when they came with it, reward, validity, and the ids of its group's rows (its
    advantage is its group's)."""
    group_of = collections.defaultdict(list)
    for t, g in zip(batch.traj_ids, np.asarray(batch.group_ids_B)):
        if t:
            group_of[int(g)].append(t)
    known_B = batch.behaviour_known_B
    keys = {}
    for b in np.flatnonzero(rows_B):
        h = hashlib.blake2b(digest_size=16)
        h.update(np.int64(batch.versions_B[b]).tobytes())
        h.update(np.float32(batch.rewards_B[b]).tobytes() + np.float32(batch.valid_B[b]).tobytes())
        h.update("\0".join(sorted(group_of[int(batch.group_ids_B[b])])).encode())
        # Trailing zeros are padding: rows packed in batches of other widths hash alike.
        arrays = [batch.tokens_BT, batch.loss_mask_BT, batch.inference_logps_BT]
        if known_B is not None and known_B[b] and batch.behaviour_logps_BT is not None:
            arrays.append(batch.behaviour_logps_BT)
        for x in arrays:
            row = np.asarray(x[b])
            nonzero = np.flatnonzero(row)
            row = row[: nonzero[-1] + 1] if nonzero.size else row[:0]
            h.update(str(row.dtype).encode() + np.ascontiguousarray(row).tobytes() + b"|")
        keys[batch.traj_ids[b]] = h.digest()
    return keys
