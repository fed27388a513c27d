"""Weights device to device: the trainer offers every version it publishes to each rollout slice
through a JAX transfer server (`jax.experimental.transfer`), and a slice pulls it straight onto
its own devices when it loads that version. The tensorstore tier stays the durable copy
(checkpoints, restarts) and the fallback whenever a pull fails.

A pull moves shards, not arrays: each device buffer the trainer offers lands on the receiving
device in the same position, so the offer must already have the slice's layout. The trainer
builds it on its first `mesh.rollout`-sized group of devices, a mesh of the rollout slice's shape
and axis names, with the rollout sharding rules, in the served dtype: one copy per version on
those devices, shared by every slice, held for the last `keep_versions` versions (a slice loads
a version within C3's window, soon after its publish) and offered for `keep_s` at most.

Rendezvous: the trainer writes its server's address to WORKDIR/weights_server.json, with one
random 64-bit transfer id per (version, slice), pulled once. The transfer server checks no
credential: the ids are what keeps a version from being pulled by someone on the network who
cannot read the workdir (who can read it can read the versions' files there anyway).
Single-process trainer and rollout slices only (a multi-host slice's shards live in several
processes); others use the tensorstore tier.
"""

from __future__ import annotations

import collections
import datetime
import json
import secrets
import socket
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from dora_jax.core import fs
from dora_jax.models.params import in_compute_dtype
from dora_jax.parallel import sharding

ADDRESS_FILE = "weights_server.json"


def new_transfer_id() -> int:
    """A transfer id no one can guess (the KV offers of kv_transfer.py draw theirs here too)."""
    return secrets.randbits(64)


def host_address() -> str:
    """This host's address as other hosts reach it: its name's address when this host can bind
    it, else the loopback (a machine whose name resolves to nothing of its own)."""
    try:
        address = socket.gethostbyname(socket.gethostname())
        with socket.socket() as probe:
            probe.bind((address, 0))
        return address
    except OSError:
        return "127.0.0.1"


_SERVERS: dict[tuple[int, str, int], object] = {}


def start_server(client, host: str | None, port: int = 0):
    """A transfer server on `host` (default: this host's address): its control port `port` and
    its bulk port `port + 1`, or any free ones with port 0 (a pod's firewall opens fixed ones)."""
    from jax.experimental import transfer

    host = host or host_address()
    return transfer.start_transfer_server(client, f"{host}:{port}", [f"{host}:{port + 1 if port else 0}"])


def transfer_server(devices: Sequence[jax.Device], host: str | None = None, port: int = 0):
    """This process's transfer server for `devices`' client on `host` and `port` (started on first
    use, then shared: the weights' pull and the KV migration of a rollout slice use one)."""
    client = devices[0].client
    key = (id(client), host or "", port)
    if key not in _SERVERS:
        _SERVERS[key] = start_server(client, host, port)
    return _SERVERS[key]


class WeightOffer:
    """Trainer side: a transfer server and, per published version, its copy in the rollout layout."""

    def __init__(
        self,
        devices: Sequence[jax.Device],
        rollout_mesh_shape: dict,
        axes,
        dtype,
        num_slices: int,
        workdir: str,
        *,
        keep_s: float = 600.0,
        keep_versions: int = 4,
        host: str | None = None,
        port: int = 0,
    ):
        size = sharding.mesh_size(rollout_mesh_shape)
        if size > len(devices):
            raise ValueError(
                f"mesh.rollout={rollout_mesh_shape} has {size} devices but the trainer has {len(devices)}: "
                "no room to lay a version out as a slice's shards"
            )
        self._mesh = sharding.make_mesh(list(devices)[:size], rollout_mesh_shape)
        self._axes, self._dtype = axes, dtype
        self._num_slices, self._keep_s = num_slices, keep_s
        self._server = start_server(devices[0].client, host, port)
        self.address = self._server.address()
        self._path = fs.join(workdir, ADDRESS_FILE)
        self._offered: collections.deque[tuple[int, list[int]]] = collections.deque(maxlen=64)  # (version, ids)
        self._write()
        self._shardings = None
        self._held: collections.deque = collections.deque(maxlen=keep_versions)
        self.bytes_per_version = 0

    def _write(self) -> None:
        # whole or not at all: every slice reads it while the trainer rewrites it at each offer
        with fs.open(self._path, "w", atomic=True) as f:
            json.dump(
                {
                    "address": self.address,
                    "versions": [version for version, _ in self._offered],
                    "ids": {str(version): ids for version, ids in self._offered},  # per slice
                },
                f,
            )

    def offer(self, version: int, params) -> float:
        """Lays `params` out as a slice's shards and offers them to every slice; returns the
        seconds it took (the trainer waits for the copy, not for the pulls)."""
        start = time.perf_counter()
        params = in_compute_dtype(params, self._dtype)
        if self._shardings is None:
            self._shardings = sharding.tree_shardings(self._axes, params, self._mesh, sharding.ROLLOUT_RULES)
        # New buffers, never the trainer's own (it donates them to its next step): device_put
        # hands a shard that is already where it should be over as it is.
        arrays = jax.block_until_ready(jax.device_put(jax.tree.map(jnp.copy, params), self._shardings))
        self.bytes_per_version = sum(x.nbytes for x in jax.tree.leaves(arrays))
        expires = datetime.datetime.now() + datetime.timedelta(seconds=self._keep_s)
        ids = [new_transfer_id() for _ in range(self._num_slices)]
        for transfer in ids:
            self._server.await_pull(transfer, arrays, timeout=expires)
        self._offered.append((int(version), ids))
        self._held.append(arrays)  # the server does not keep them alive until they are pulled
        self._write()
        return time.perf_counter() - start


class WeightPull:
    """Rollout side: pulls a version offered by the trainer onto this slice's devices, laid out
    as `shardings` (the engine's param shardings) in `dtype`."""

    def __init__(
        self, devices: Sequence[jax.Device], workdir: str, slice_id: int, *, host: str | None = None, port: int = 0
    ):
        self._server = transfer_server(devices, host, port)
        self._path, self._slice_id = fs.join(workdir, ADDRESS_FILE), slice_id
        self._connection, self._address = None, None
        self._pulled: set[tuple[str, int]] = set()

    def pull(self, version: int, abstract_params, timeout_s: float = 30.0):
        """The params of `version` (a tree of ShapeDtypeStructs with shardings gives their form);
        raises NotOffered when the trainer has no offer left for this slice (a version it
        published again after a restart, or one this slice pulled already): read the tensorstore
        tier then."""
        with fs.open(self._path) as f:
            offers = json.load(f)
        address, version = offers["address"], int(version)
        if version not in offers["versions"] or (address, version) in self._pulled:
            raise NotOffered(f"version {version} is not on offer for slice {self._slice_id} at {address}")
        if address != self._address:  # a restarted trainer has a new server
            self._connection, self._address = self._server.connect(address), address
        self._pulled.add((address, version))
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        transfer = int(offers["ids"][str(version)][self._slice_id])
        params = self._connection.pull(transfer, abstract_params, timeout=deadline)
        return jax.block_until_ready(params)


class NotOffered(LookupError):
    pass
