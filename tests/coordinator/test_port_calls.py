"""Results applied while the loop waits on a slice command (`apply_results_during_calls`,
dora_jax.coordinator.port_calls): the trainer is not held up by another slice's switch, and
every invariant holds when results land in the middle of a switching pass."""

import dataclasses
import random
import time

import pytest

from dora_jax.coordinator.audit import audit
from dora_jax.coordinator.coordinator import Coordinator
from dora_jax.coordinator.ledger import Ledger
from tests.coordinator.fakes import FakeWorker, InstantScorer, config, drive, longtail, prompts, tick_some


class _BusyNeighbourWorker(FakeWorker):
    """A slice whose commands take a while, during which the other slices decode (they tick from
    inside the call, so their results arrive while the loop waits on it); after an import it
    decodes itself too, as a worker does before its reply arrives."""

    def __init__(self, *args, workers, rng, **kwargs):
        super().__init__(*args, **kwargs)
        self.workers, self.rng = workers, rng
        self.calls = 0

    def _others_decode(self):
        self.calls += 1
        others = {sid: w for sid, w in self.workers.items() if w is not self}
        for _ in range(self.rng.randint(0, 3)):
            tick_some(others, self.rng)

    def submit(self, requests):
        self._others_decode()
        return super().submit(requests)

    def load_version(self, version):
        self._others_decode()
        return super().load_version(version)

    def export(self, traj_ids, kv=True):
        self._others_decode()
        return super().export(traj_ids, kv)

    def import_(self, items):
        self._others_decode()
        reprefilled = super().import_(items)
        for _ in range(self.rng.randint(0, 3)):
            self.tick()
        return reprefilled


def _run(mode, *, apply, steps=8, seed=0):
    ref, rng = [None], random.Random(seed)
    length_of = longtail(seed)
    workers: dict = {}
    for i in range(3):
        workers[i] = _BusyNeighbourWorker(i, 4, ref, length_of, workers=workers, rng=rng)
    ledger = Ledger(None)
    cfg = dataclasses.replace(config(mode), apply_results_during_calls=apply)
    coord = Coordinator(cfg, workers, prompts(), InstantScorer(), ledger)
    ref[0] = coord
    coord.start()
    drive(coord, workers, rng, steps)
    return coord, workers, ledger.memory


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "partial_rollout", "dora"])
def test_results_that_land_during_a_pass_keep_every_invariant(mode):
    """Other slices' results arrive during each submit and load (the audit: C1-C3, exactly once,
    the ledger's order), and the run gets as far as when they wait for the pass."""
    coord, workers, events = _run(mode, apply=True)
    assert audit(events).ok, audit(events).violations[:5]
    assert sum(w.calls for w in workers.values()) > 20
    assert coord.stats.port_wait_s["submit"] > 0
    assert len([e for e in events if e["ev"] == "consume"]) == 8 * 8
    if mode in ("dora", "partial_rollout"):
        assert coord.stats.port_wait_s["export"] > 0 and coord.stats.port_wait_s["import_"] > 0
    # In the ledger each result comes from the slice its request was last sent or moved to.
    on: dict = {}
    for e in events:
        if e["ev"] == "dispatch":
            on[e["traj"]] = e["slice"]
        elif e["ev"] == "migrate":
            on[e["traj"]] = e["to"]
        elif e["ev"] == "finish":
            assert on.pop(e["traj"]) == e["slice"], e


class _SlowLoadWorker(FakeWorker):
    """A slice whose version load lasts until another slice's result has been applied, or
    `patience` seconds: it records which (the loop thread applies results; the call runs on
    its own thread only with `apply_results_during_calls`)."""

    def __init__(self, *args, neighbour, patience, **kwargs):
        super().__init__(*args, **kwargs)
        self.neighbour, self.patience = neighbour, patience
        self.applied_during_load: list[bool] = []

    def load_version(self, version):
        coord = self._coord[0]
        if self.neighbour.active:  # the other slice is decoding: it finishes one, then we wait
            before = coord.stats.finished
            decoding = set(self.neighbour.active)
            while decoding <= set(self.neighbour.active):
                self.neighbour.tick()  # posts what finished to the coordinator's inbox
            deadline = time.monotonic() + self.patience
            while coord.stats.finished == before and time.monotonic() < deadline:
                time.sleep(0.001)
            self.applied_during_load.append(coord.stats.finished > before)
        return super().load_version(version)


@pytest.mark.parametrize("apply", [True, False])
def test_another_slices_results_are_applied_while_a_slice_loads(apply):
    """dora on two slices: each time slice 1 loads a version while slice 0 decodes, slice 0's
    results are applied (and the trainer could take them) before the load returns; when the loop
    waits for the call instead, they are not."""
    ref, length_of = [None], longtail(1)
    w0 = FakeWorker(0, 4, ref, length_of)
    w1 = _SlowLoadWorker(1, 4, ref, length_of, neighbour=w0, patience=2.0 if apply else 0.2)
    workers = {0: w0, 1: w1}
    cfg = dataclasses.replace(config("dora"), apply_results_during_calls=apply)
    coord = Coordinator(cfg, workers, prompts(), InstantScorer(), Ledger(None))
    ref[0] = coord
    coord.start()
    drive(coord, workers, random.Random(1), 6)
    assert w1.applied_during_load, "slice 1 never loaded while slice 0 decoded"
    assert all(w1.applied_during_load) if apply else not any(w1.applied_during_load)
    assert audit(coord.ledger.memory).ok
