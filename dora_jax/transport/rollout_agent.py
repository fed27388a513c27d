"""The rollout worker's side of the service: one RolloutWorker driven by the coordinator's commands.

`RolloutAgent.run()` registers the slice, opens the command stream (a reader thread), beats
(another thread), and loops on its own thread, as `WorkerThread` does in process: run the
commands that arrived (submit, load a version, export, import, stop), answering each with one
`Ack`, then one `worker.step()`, whose finished trajectories are posted (and acknowledged) before
the next command runs. Fetching a version's params is the caller's `fetch_params(version)`
(the tensorstore tier in `python -m dora_jax.rollout_worker`).

Ends: a Stop command (returns "stopped"); the coordinator unreachable past the client deadline
when joining (raises CoordinatorUnreachable); a command the worker cannot execute (answered with
the error, then raised). If the coordinator ends the session (it declared the slice failed, e.g.
after a stall, or a restarted trainer sent the run back to its checkpoint) or goes away (its
stream breaks or falls silent past `silence_s`: a restarted coordinator comes back on the same
address), the agent drops its requests, which the coordinator re-dispatches, and registers again:
the slice rejoins with nothing loaded.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np

from dora_jax.core.records import Reprefill, SlotState
from dora_jax.rollout.timeline import BusyTimeline
from dora_jax.rollout.worker import RolloutWorker, export_from, import_into
from dora_jax.transport import codec, kv_transfer
from dora_jax.transport import dora_pb2 as pb
from dora_jax.transport.client import Client, CoordinatorUnreachable, SessionLost

_LOST = "lost"


class RolloutAgent:
    def __init__(
        self,
        client: Client,
        worker: RolloutWorker,
        fetch_params: Callable[[int], object],
        config_hash: str,
        *,
        silence_s: float = 60.0,
        chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES,
        kv_transfer=None,
        log=print,
        before_step: Callable[[int], None] | None = None,
    ):
        """`kv_transfer` (a KVTransfer): migrated KV rows go device to device between slices, the
        coordinator carrying only their tickets; None sends them through the coordinator.
        `before_step(active)` runs before each worker step with the number of requests in its
        slots (fault injection: dora_jax/runtime/faults.py)."""
        self.client = client
        self.worker = worker
        self.kv_transfer = kv_transfer
        self._fetch_params = fetch_params
        self._config_hash = config_hash
        self._silence_s = silence_s
        self._chunk_bytes = chunk_bytes
        self._log = log
        self._before_step = before_step
        self._inbox: queue.Queue[tuple] = queue.Queue()
        self._done = threading.Event()
        self._seq = 0
        self.busy_s = 0.0
        self.timeline = BusyTimeline()  # wall-clock bars of decode steps (dora_jax/rollout/timeline.py)
        self.rejoins = 0
        self._reader: threading.Thread | None = None

    # ------------------------------------------------------------------ session
    def register(self) -> None:
        reply = self.client.register(
            pb.ROLLOUT,
            self._config_hash,
            slice_id=self.worker.slice_id,
            num_slots=self.worker.num_slots,
            transfer_address=self.kv_transfer.address if self.kv_transfer is not None else "",
        )
        self._period = reply.heartbeat_period_s
        self._seq = 0

    def run(self) -> str:
        """Serves commands until Stop; see the module docstring. Call `register()` first."""
        while True:
            session = self.client.session
            self._done.clear()
            stream = self.client.stub.Commands(pb.CommandsRequest(session=session))  # open for the session's life
            reader = threading.Thread(target=self._read_commands, args=(stream,), daemon=True, name="commands")
            self._reader = reader
            beater = threading.Thread(target=self._beat, args=(session,), daemon=True, name="heartbeat")
            reader.start()
            beater.start()
            try:
                return self._serve()
            except (SessionLost, CoordinatorUnreachable) as err:
                stop = self._stop_behind()
                if stop is not None:
                    return f"stopped: {stop}"
                lost = err
            finally:
                self._done.set()
                stream.cancel()
                reader.join(timeout=5)
                beater.join(timeout=5)
            if isinstance(lost, SessionLost):
                self._log(f"slice {self.worker.slice_id}: {lost}; dropping its requests and joining again")
            else:  # a restarted coordinator re-dispatches from its checkpoint
                self._log(
                    f"slice {self.worker.slice_id}: {lost}; dropping its requests and joining again once "
                    "the coordinator answers"
                )
            self._reset()
            self.rejoins += 1
            self.register()

    def _reset(self) -> None:
        """Forgets every request: the coordinator re-dispatched them when it ended the session."""
        if self.worker.active_traj_ids:
            self.worker.export_requests()
        self.worker.take_queued()
        if self.worker.has_work:
            self.worker.step()  # flushes requests rejected at submit; nothing else is left
        self._inbox = queue.Queue()

    def _read_commands(self, stream) -> None:
        try:
            for message, arrays in codec.FrameReader(iter(stream)):
                self._inbox.put(("command", message, arrays))
            self._inbox.put((_LOST, "the coordinator closed the command stream", CoordinatorUnreachable))
        except grpc.RpcError as err:
            if not self._done.is_set():
                kind = SessionLost if err.code() == grpc.StatusCode.NOT_FOUND else CoordinatorUnreachable
                self._inbox.put((_LOST, f"command stream broke: {err.code().name}: {err.details()}", kind))
        except Exception as err:
            self._inbox.put((_LOST, f"bad command stream: {type(err).__name__}: {err}", RuntimeError))

    def _beat(self, session: str) -> None:
        counters = self.worker.counters
        while not self._done.wait(self._period):
            try:  # the loop thread updates the counters meanwhile: a torn read is skipped
                counters = self.worker.counters
            except RuntimeError:
                pass
            request = pb.HeartbeatRequest(
                session=session,
                slot_steps=counters.slot_steps,
                idle_slot_steps=counters.idle_slot_steps,
                generated_tokens=counters.generated_tokens,
                preemptions=counters.preemptions,
                busy_s=self.busy_s,
            )
            try:
                self.client.call("Heartbeat", lambda t, request=request: self.client.stub.Heartbeat(request, timeout=t))
            except (SessionLost, CoordinatorUnreachable) as err:
                self._inbox.put((_LOST, str(err), type(err)))
                return
            except Exception as err:
                self._inbox.put((_LOST, f"heartbeat failed: {err}", CoordinatorUnreachable))
                return

    # ------------------------------------------------------------------ the loop
    def _serve(self) -> str:
        last_heard = time.monotonic()
        while True:
            block = not self.worker.has_work
            try:
                item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
            except queue.Empty:
                item = None
            while item is not None:
                if item[0] == _LOST:
                    raise item[2](f"slice {self.worker.slice_id}: {item[1]}")
                last_heard = time.monotonic()
                _, message, arrays = item
                kind = message.WhichOneof("kind")
                if kind == "stop":
                    return f"stopped: {message.stop.reason}"
                if kind != "keepalive":
                    self._execute(message, arrays)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = None
            if time.monotonic() - last_heard > self._silence_s:
                raise CoordinatorUnreachable(
                    f"slice {self.worker.slice_id}: no word from the coordinator at "
                    f"{self.client.address} for {self._silence_s:.0f}s (not even a keepalive)"
                )
            if self.worker.has_work:
                start, wall = time.perf_counter(), time.time()
                active = len(self.worker.active_traj_ids)
                if self._before_step is not None:
                    self._before_step(active)
                occupancy = active / self.worker.num_slots
                finished = self.worker.step()
                seconds = time.perf_counter() - start
                self.busy_s += seconds
                self.timeline.step(wall, wall + seconds, self.worker.version, occupancy)
                if finished:
                    self._post_finished(finished)

    def _stop_behind(self) -> str | None:
        """At the end of a run the coordinator queues Stop and ends the session: a heartbeat may
        learn of the end before the stream delivers the Stop. Lets the stream finish (briefly)
        and returns the reason of a Stop found behind the loss, if any."""
        if self._reader is not None:
            self._reader.join(timeout=2.0)
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return None
            if item[0] == "command" and item[1].WhichOneof("kind") == "stop":
                return item[1].stop.reason

    def _execute(self, command: pb.Command, arrays: list[np.ndarray]) -> None:
        kind = command.WhichOneof("kind")
        if self.kv_transfer is not None:
            self.kv_transfer.prune()  # offers past their time leave the devices
        exported, out_arrays, progress, digest, reprefilled = [], [], [], "", []
        try:
            if kind == "submit":
                for request in command.submit.requests:
                    self.worker.submit(codec.request_from_proto(request))
            elif kind == "load_version":
                version = int(command.load_version.version)
                digest = self.worker.load_version(version, self._fetch_params(version))
            elif kind == "export":
                exported, out_arrays = codec.migratables_to_proto(
                    self._export(list(command.export.traj_ids), kv=not command.export.without_kv)
                )
            elif kind == "import_items":
                items = codec.migratables_from_proto(command.import_items.items, iter(arrays))
                resolved = self._resolve(items)
                import_into(self.worker, resolved)
                reprefilled = [  # their KV rows could not be pulled: the coordinator's ledger says so
                    old.request.traj_id
                    for old, new in zip(items, resolved, strict=True)
                    if isinstance(old, SlotState) and isinstance(new, Reprefill)
                ]
            elif kind == "progress":
                progress = [codec.request_to_proto(r) for r in self.worker.progress().values()]
            else:
                raise ValueError(f"unknown command kind {kind!r}")
        except Exception as err:
            self._ack(
                pb.Result(session=self.client.session, command_id=command.id, error=f"{type(err).__name__}: {err}"), []
            )
            raise
        self._ack(
            pb.Result(
                session=self.client.session,
                command_id=command.id,
                exported=exported,
                progress=progress,
                digest=digest,
                reprefilled=reprefilled,
            ),
            out_arrays,
        )

    def _export(self, traj_ids: list[str], kv: bool) -> list:
        """Exported requests; with a KV transfer, admitted ones' rows stay on the devices, offered
        (through the coordinator otherwise, or where an offer fails)."""
        if self.kv_transfer is None:
            return export_from(self.worker, traj_ids, kv=kv)
        out = []
        for item in export_from(self.worker, traj_ids, to_host=False, kv=kv):
            if isinstance(item, SlotState):
                try:
                    item = self.kv_transfer.offer(item)
                except Exception as err:  # noqa: BLE001 - its rows go through the coordinator instead
                    self._log(f"offering the KV of {item.request.traj_id} failed ({err}); sending it inline")
                    item = dataclasses.replace(item, k_LSKD=np.asarray(item.k_LSKD), v_LSKD=np.asarray(item.v_LSKD))
            out.append(item)
        return out

    def _resolve(self, items: list) -> list:
        """Imported items with ticketed KV rows pulled from their source slice (re-prefilled where
        that fails, or where this agent has no transfer server to pull with)."""
        if self.kv_transfer is not None:
            return self.kv_transfer.resolve(items, self.worker.migration, self._log)
        ticketed = lambda i: isinstance(i, SlotState) and i.kv_ticket is not None  # noqa: E731
        if any(map(ticketed, items)):
            self._log("migrated slots came with KV tickets but this slice has no transfer server: re-prefilled")
        return [kv_transfer.fallback(i) if ticketed(i) else i for i in items]

    def _ack(self, result: pb.Result, arrays: list[np.ndarray]) -> None:
        # The frames are rebuilt on every try: a stream iterator is consumed by the failed attempt.
        self.client.call(
            "Ack", lambda t: self.client.stub.Ack(codec.to_frames(result, arrays, self._chunk_bytes), timeout=t)
        )

    def _post_finished(self, finished) -> None:
        self._seq += 1
        request = pb.FinishedRequest(
            session=self.client.session, seq=self._seq, trajectories=[codec.trajectory_to_proto(t) for t in finished]
        )
        self.client.call("PostFinished", lambda t: self.client.stub.PostFinished(request, timeout=t))


def fetch_from_store(store, shardings, *, wait_s: float = 0.0) -> Callable[[int], object]:
    """`fetch_params` over a ParamStore: version -> params laid out as `shardings`, waiting up to
    `wait_s` for a version another process has not committed yet."""

    def fetch(version: int):
        deadline, pause = time.monotonic() + wait_s, 0.01
        while version not in store.versions() and time.monotonic() < deadline:
            time.sleep(pause)  # a version committing now is seen within ~10 ms; a long wait lists 5x a second
            pause = min(2 * pause, 0.2)
        return store.get(version, shardings)

    return fetch
