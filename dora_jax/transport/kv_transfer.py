"""KV migration slice to slice: the coordinator carries only a migrated slot's metadata, the KV
rows go straight from the source slice's devices to the destination's through JAX transfer
servers (`jax.experimental.transfer`, one per process, shared with the weights' pull).

The source exports a slot with its rows left on its devices (`export_slot(to_host=False)`: laid
out as a Prefix, padded to their rows bucket) and `offer`s them under a fresh id: the SlotState
it sends on carries a `KVTicket` (its server's address and that id) and the rows' shapes, not
their bytes. The destination `pull`s them onto its own devices in the same layout (every rollout
slice has the same mesh shape) and imports the slot with no prefill. A pull that fails (the source
died, the offer expired) costs nothing sampled: the destination re-prefills the request from its
tokens so far, under its own version (`fallback`). The pull's bytes and seconds feed the
migration rule's link rate (dora_jax.rollout.migration).

Offers are held on the source's devices for `keep_s` (the coordinator imports right after it
exports; the source is not told when a pull is done), dropped at the next offer, import or agent
command after that. Offer ids are random 64-bit numbers: only the destination the coordinator
hands the ticket to can name an offer (the transfer server itself checks no credential), and the
coordinator relays a ticket only if it names the transfer server its slice registered with. Single-process
slices only (a multi-host slice's shards live in several processes): those send the rows through
the coordinator.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import time

import jax

from dora_jax.core.records import KVTicket, Reprefill, SlotState
from dora_jax.rollout.worker import as_redispatch
from dora_jax.transport import weights


class KVTransfer:
    """One rollout slice process's KV offers and pulls, on its engine's devices and layout."""

    def __init__(
        self, engine, *, host: str | None = None, port: int = 0, keep_s: float = 10.0, pull_timeout_s: float = 20.0
    ):
        self._server = weights.transfer_server(list(engine.mesh.devices.flat), host, port)
        self.address = self._server.address()
        self._prefix = engine.get_prefix_destination_sharding()
        self._keep_s, self._pull_timeout_s = keep_s, pull_timeout_s
        self._held: collections.deque[tuple[float, tuple]] = collections.deque()
        self._connections: dict[str, object] = {}
        self.pulled_bytes, self.pull_s, self.failures = 0, 0.0, 0

    def offer(self, state: SlotState) -> SlotState:
        """`state` (its rows on this slice's devices) offered for one pull; returns it with a ticket."""
        self.prune()
        now = time.monotonic()
        uuid = weights.new_transfer_id()  # unguessable: a pull needs the ticket the coordinator relays
        arrays = (state.k_LSKD, state.v_LSKD)
        expires = datetime.datetime.now() + datetime.timedelta(seconds=self._keep_s)
        self._server.await_pull(uuid, arrays, timeout=expires)
        self._held.append((now + self._keep_s, arrays))  # the server does not keep them alive
        return dataclasses.replace(state, kv_ticket=KVTicket(self.address, uuid))

    def prune(self) -> None:
        """Drops the offers past `keep_s` (pulled long ago, or never)."""
        now = time.monotonic()
        while self._held and self._held[0][0] < now:
            self._held.popleft()

    def pull(self, state: SlotState) -> tuple[SlotState, float]:
        """The ticketed `state` with its rows on this slice's devices, and the seconds the pull took
        (not counting a first connection to its server); raises if the pull fails."""
        ticket = state.kv_ticket
        connection = self._connections.get(ticket.address)
        if connection is None:
            connection = self._connections[ticket.address] = self._server.connect(ticket.address)
        abstract = tuple(
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
            for x, s in ((state.k_LSKD, self._prefix.k_LRKD), (state.v_LSKD, self._prefix.v_LRKD))
        )
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=self._pull_timeout_s)
        start = time.perf_counter()
        k, v = connection.pull(ticket.uuid, abstract, timeout=deadline)
        # A pull of an id the server never offered waits forever (the deadline only bounds an
        # offer's wait for its pull): poll, and give up at the deadline.
        while not (k.is_ready() and v.is_ready()):
            if time.perf_counter() - start > self._pull_timeout_s:
                raise TimeoutError(
                    f"no KV rows under id {ticket.uuid} at {ticket.address} after {self._pull_timeout_s} s"
                )
            time.sleep(0.001)
        k, v = jax.block_until_ready((k, v))  # raises if the transfer failed
        seconds = time.perf_counter() - start
        self.pull_s += seconds
        self.pulled_bytes += state.num_bytes
        return dataclasses.replace(state, k_LSKD=k, v_LSKD=v, kv_ticket=None), seconds

    def resolve(self, items: list, migration=None, log=print) -> list:
        """`items` of an import with every ticketed SlotState pulled (each pull's bytes and seconds
        observed by `migration`, a MigrationCosts) or, where its pull fails, turned into a
        Reprefill; after one failure the other rows from that server are not tried (its process is
        likely gone) and the connection to it is dropped."""
        out, failed = [], set()
        self.prune()
        for item in items:
            if not isinstance(item, SlotState) or item.kv_ticket is None:
                out.append(item)
                continue
            address = item.kv_ticket.address
            try:
                if address in failed:
                    raise ConnectionError("an earlier pull from it failed")
                pulled, seconds = self.pull(item)
            except Exception as err:  # noqa: BLE001 - the request is re-prefilled: nothing lost
                self.failures += 1
                failed.add(address)
                self._connections.pop(address, None)
                log(f"KV pull of {item.request.traj_id} from {address} failed ({err}); re-prefilling")
                out.append(fallback(item))
                continue
            if migration is not None:
                migration.observe_link(item.num_bytes, seconds)
            out.append(pulled)
        return out


def fallback(state: SlotState) -> Reprefill:
    """A migrated slot whose rows cannot be had, resumed by re-prefill of its tokens so far."""
    return Reprefill(as_redispatch(state))
