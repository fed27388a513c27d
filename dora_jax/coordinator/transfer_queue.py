"""The streaming TransferQueue: complete, scored groups waiting for the trainer, oldest version first."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable

from dora_jax.core.records import Group


class TransferQueue:
    """Groups enter whole (all G samples finished and scored); the trainer takes them by
    (version, arrival) so that old versions drain first and the version window can slide."""

    def __init__(self):
        self._groups: list[tuple[int, int, Group]] = []
        self._arrival = itertools.count()
        self._samples = 0

    def put(self, group: Group) -> None:
        bisect.insort(self._groups, (group.version, next(self._arrival), group), key=lambda item: item[:2])
        self._samples += len(group.samples)

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def num_samples(self) -> int:
        return self._samples

    def versions(self) -> Iterable[int]:
        return (version for version, _, _ in self._groups)

    def peek_oldest(self, num_groups: int) -> list[Group]:
        return [g for _, _, g in self._groups[:num_groups]]

    def take_oldest(self, num_groups: int) -> list[Group]:
        taken, self._groups = self._groups[:num_groups], self._groups[num_groups:]
        self._samples -= sum(len(g.samples) for _, _, g in taken)
        return [g for _, _, g in taken]

    def drain(self) -> list[Group]:
        return self.take_oldest(len(self._groups))
