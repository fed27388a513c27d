"""The streaming TransferQueue: complete, scored groups waiting for the trainer, oldest version first."""

from __future__ import annotations

import itertools
from typing import Iterable

from dora_jax.records import Group


class TransferQueue:
    """Groups enter whole (all G samples finished and scored); the trainer takes them by
    (version, arrival) so that old versions drain first and the version window can slide."""

    def __init__(self):
        self._groups: list[tuple[int, int, Group]] = []
        self._arrival = itertools.count()

    def put(self, group: Group) -> None:
        self._groups.append((group.version, next(self._arrival), group))
        self._groups.sort(key=lambda item: item[:2])

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def num_samples(self) -> int:
        return sum(len(g.samples) for _, _, g in self._groups)

    def versions(self) -> Iterable[int]:
        return (version for version, _, _ in self._groups)

    def peek_oldest(self, num_groups: int) -> list[Group]:
        return [g for _, _, g in self._groups[:num_groups]]

    def take_oldest(self, num_groups: int) -> list[Group]:
        taken, self._groups = self._groups[:num_groups], self._groups[num_groups:]
        return [g for _, _, g in taken]

    def drain(self) -> list[Group]:
        return self.take_oldest(len(self._groups))
