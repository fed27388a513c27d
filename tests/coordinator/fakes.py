"""Scripted fake rollout workers: a unit-test stand-in for RolloutWorker behind the same port.

Each request decodes one token per `tick`, up to a scripted length; the per-token version is the
version loaded at that tick, so versions_seen is observed, not copied. The real worker is tested
in tests/rollout and end to end in tests/test_train_smoke.py.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future

import numpy as np

from dora_jax.core.records import FinishReason, Reprefill, Request, SlotState, Trajectory


class FakeWorker:
    def __init__(self, slice_id, num_slots, coordinator_ref, length_of, *, reprefill_every=0, pull_fails_every=0):
        """`reprefill_every` = n: every n-th admitted request exported leaves as a Reprefill (the
        migration rule's other way), with its tokens so far as its prefix. `pull_fails_every` = n:
        every n-th SlotState imported cannot have its KV rows (a failed pull) and is re-prefilled
        here, its id returned by `import_` as a remote slice's result says."""
        self.slice_id, self.num_slots = slice_id, num_slots
        self._reprefill_every, self._exported = reprefill_every, 0
        self._pull_fails_every, self._imported = pull_fails_every, 0
        self._coord = coordinator_ref  # a one-element list, filled once the coordinator exists
        self._length_of = length_of
        self.version = None
        self.queued: list[Request] = []
        self.active: dict[str, dict] = {}
        self.prefills = 0
        self.imports_kv = 0
        self.idle_slot_ticks = 0
        self.slot_ticks = 0

    # -- port
    def submit(self, requests):
        self.queued += list(requests)

    def load_version(self, version):
        if self.active or self.queued:
            raise RuntimeError(f"fake slice {self.slice_id}: load_version with requests on it")
        self.version = version
        return f"fake-params-v{version}"  # the digest of what was loaded

    def export(self, traj_ids, kv=True):
        out = []
        for traj_id in traj_ids:
            if traj_id in self.active:
                st = self.active.pop(traj_id)
                self._exported += 1
                if self._reprefill_every and self._exported % self._reprefill_every == 0:
                    out.append(Reprefill(_resumption(st)))
                    continue
                out.append(
                    SlotState(
                        st["req"],
                        np.zeros((1, 1, 1, 1)),
                        np.zeros((1, 1, 1, 1)),
                        0,
                        0,
                        tuple(st["tokens"]),
                        tuple(st["logps"]),
                        tuple(st["versions"]),
                        np.zeros(2, np.uint32),
                        self.version,
                    )
                )
            else:
                for r in list(self.queued):
                    if r.traj_id == traj_id:
                        self.queued.remove(r)
                        out.append(r)
        return out

    def import_(self, items):
        reprefilled = []
        for item in items:
            if isinstance(item, SlotState):
                self._imported += 1
                if self._pull_fails_every and self._imported % self._pull_fails_every == 0:
                    st = dict(req=item.request, tokens=item.response_ids, logps=item.logprobs)
                    self.queued.append(_resumption(dict(st, versions=item.token_versions)))
                    reprefilled.append(item.request.traj_id)
                    continue
                self.active[item.request.traj_id] = dict(
                    req=item.request,
                    tokens=list(item.response_ids),
                    logps=list(item.logprobs),
                    versions=list(item.token_versions),
                )
                self.imports_kv += 1
            else:
                self.queued.append(item.request if isinstance(item, Reprefill) else item)
        return reprefilled or None

    def progress(self):
        out = {r.traj_id: r for r in self.queued}
        for traj_id, st in self.active.items():
            out[traj_id] = _resumption(st)
        return out

    # -- the scripted decode loop
    def tick(self):
        while self.queued and len(self.active) < self.num_slots:
            r = self.queued.pop(0)
            self.prefills += 1
            self.active[r.traj_id] = dict(
                req=r,
                tokens=list(r.prefix_response_ids),
                logps=list(r.prefix_logprobs),
                versions=list(r.prefix_versions),
            )
        self.slot_ticks += self.num_slots
        self.idle_slot_ticks += self.num_slots - len(self.active)
        done = []
        for traj_id, st in list(self.active.items()):
            st["tokens"].append(1)
            st["logps"].append(-0.5)
            st["versions"].append(self.version)
            r = st["req"]
            target = r.forced_length or self._length_of(traj_id)
            if len(st["tokens"]) >= min(target, r.max_new_tokens):
                del self.active[traj_id]
                done.append(
                    Trajectory(
                        traj_id,
                        r.group_id,
                        r.prompt_id,
                        r.prompt_ids,
                        tuple(st["tokens"]),
                        tuple(st["logps"]),
                        r.version,
                        tuple(sorted(set(st["versions"]))),
                        FinishReason.LENGTH,
                        self.slice_id,
                    )
                )
        if done:
            self._coord[0].post_finished(self.slice_id, done)


def _resumption(st: dict) -> Request:
    return dataclasses.replace(
        st["req"],
        prefix_response_ids=tuple(st["tokens"]),
        prefix_logprobs=tuple(st["logps"]),
        prefix_versions=tuple(st["versions"]),
    )


class DyingWorker(FakeWorker):
    """A FakeWorker that can die or hang: then it decodes nothing and every port call raises (a
    hung one as a command that timed out does)."""

    dead = False
    hung = False

    def __getattribute__(self, name):
        if name in ("submit", "load_version", "export", "import_", "progress"):
            sid = object.__getattribute__(self, "slice_id")
            if object.__getattribute__(self, "dead"):
                raise ConnectionError(f"fake slice {sid} is dead")
            if object.__getattribute__(self, "hung"):
                raise TimeoutError(f"fake slice {sid}: no answer (hung)")
        return object.__getattribute__(self, name)

    def tick(self):
        if not self.dead and not self.hung:
            super().tick()


class InstantScorer:
    """Scores synchronously; `fail_every` masks some samples with an error, as a bad reward would."""

    def __init__(self, fail_every: int = 0):
        self.fail_every = fail_every
        self.count = 0

    def submit(self, trajectory):
        self.count += 1
        future = Future()
        if self.fail_every and self.count % self.fail_every == 0:
            future.set_result((0.0, "reward timeout"))
        else:
            future.set_result((float(len(trajectory.response_ids) % 2), None))
        return future


def longtail(seed, median=6, cap=80):
    """A long-tailed length per trajectory id (lognormal, capped), fixed once drawn."""
    rng = np.random.default_rng(seed)
    cache = {}

    def length_of(traj_id):
        if traj_id not in cache:
            cache[traj_id] = int(min(cap, max(1, rng.lognormal(np.log(median), 1.0))))
        return cache[traj_id]

    return length_of


def config(mode, *, k_max=2, tbs=8, rbs=16, g=4, vocab_size=0):
    """The scripted tests' coordinator settings: no periodic rebalance, responses up to 200 tokens
    (of token id 1: a `vocab_size` of 2 or more admits them)."""
    from dora_jax.coordinator.coordinator import CoordinatorConfig

    return CoordinatorConfig(
        mode=mode,
        k_max=k_max,
        train_batch_size=tbs,
        rollout_batch_size=rbs,
        group_size=g,
        max_new_tokens=200,
        rebalance_period_s=1e9,
        vocab_size=vocab_size,
    )


def make_coordinator(
    mode,
    ledger,
    *,
    slices=3,
    slots=4,
    k_max=2,
    tbs=8,
    rbs=16,
    g=4,
    seed=0,
    initial_version=0,
    on_slice_dropped=None,
    vocab_size=0,
):
    """A coordinator over `slices` DyingWorkers with long-tailed lengths; returns (coord, workers)."""
    from dora_jax.coordinator.coordinator import Coordinator

    ref = [None]
    length_of = longtail(seed)
    workers = {i: DyingWorker(i, slots, ref, length_of) for i in range(slices)}
    cfg = config(mode, k_max=k_max, tbs=tbs, rbs=rbs, g=g, vocab_size=vocab_size)
    counter = iter(range(10**9))
    coord = Coordinator(
        cfg,
        workers,
        lambda: (f"p{next(counter)}", (1, 2, 3)),
        InstantScorer(),
        ledger,
        initial_version=initial_version,
        **({"on_slice_dropped": on_slice_dropped} if on_slice_dropped else {}),
    )
    ref[0] = coord
    coord.length_of = length_of  # for workers that join later
    return coord, workers


def prompts():
    counter = iter(range(10**9))

    def next_prompt():
        i = next(counter)
        return f"p{i}", (1, 2, 3)

    return next_prompt


def drive(coord, workers, rng, steps, each_pass=None) -> None:
    """Scheduling rounds (`tick_some`, then `process`) until the trainer has taken `steps` batches,
    publishing a version after each take; `each_pass()` first in every round."""
    version, passes = 0, 0
    while version < steps:
        passes += 1
        assert passes < 20000, "no progress"
        if each_pass is not None:
            each_pass()
        tick_some(workers, rng)
        coord.process()
        if coord.try_take_batch(version) is not None:
            version += 1
            coord.post_published(version)
            coord.process()


def tick_some(workers, rng) -> None:
    """One scheduling round: a random non-empty subset of the slices decodes a token, in random order."""
    order = list(workers.values())
    rng.shuffle(order)
    for w in order[: rng.randint(1, len(order))]:
        w.tick()
