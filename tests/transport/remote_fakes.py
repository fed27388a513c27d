"""The real CoordinatorService and Coordinator on a local port, with scripted fake workers
(tests/coordinator/fakes.py) speaking the real protocol, and a trainer through the real stub.

`RemoteFake` is a FakeWorker behind the gRPC protocol, as `RolloutAgent` puts a RolloutWorker:
it registers its slice, opens its command stream, runs each command on the fake and acknowledges
it, beats, decodes a token per turn and posts what finishes (`PostFinished`, numbered). A session
the coordinator ends (its slice failed) is joined again with a fresh fake, as a real worker does.
`RemoteRun` wires them to a Coordinator exactly as `serve_coordinator` does (wait for every role,
attach, start, a loop thread calling `process`) and trains through `TakeBatch`/`ReportPublished`.

Every server and every client is made by `serve` and `connect` here alone: authentication added
to the service is one change to these two.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback

import grpc

import dora_jax
from dora_jax.coordinator.coordinator import Coordinator
from dora_jax.coordinator.ledger import Ledger
from dora_jax.transport import auth, codec
from dora_jax.transport import dora_pb2 as pb
from dora_jax.transport.client import CallFailed, Client, ClientTiming, SessionLost
from dora_jax.transport.service import CoordinatorService, HeldOut, Identity, Timing, make_server
from tests.coordinator.fakes import FakeWorker, InstantScorer, config, longtail, prompts

HASH = "5eed" * 16
TIMING = Timing(heartbeat_period_s=0.05, heartbeat_timeout_s=10.0, command_timeout_s=10.0, rejoin_timeout_s=120.0)


SECRET = bytes(range(32))  # the run secret of a RemoteRun: each role presents its own token, as on a pod


def serve(service: CoordinatorService, secret: bytes | None = None):
    """(server, address) of `service` on a free loopback port; with `secret`, role tokens checked."""
    authenticator = auth.Authenticator(secret, service.identity.num_slices) if secret else None
    server, port = make_server(service, 0, host="127.0.0.1", auth=authenticator)
    return server, f"127.0.0.1:{port}"


def connect(address: str, principal: auth.Principal | None = None, secret: bytes = SECRET) -> Client:
    """A client; with `principal`, presenting that role's token of `secret`."""
    credentials = auth.ClientCredentials(auth.role_token(secret, principal)) if principal else None
    timing = ClientTiming(call_timeout_s=10.0, unreachable_after_s=30.0, backoff_s=0.02)
    return Client(address, timing, credentials)


class RemoteFake:
    def __init__(self, address: str, slice_id: int, num_slots: int, length_of):
        self.client = connect(address, auth.rollout(slice_id))
        self.slice_id, self.num_slots, self._length_of = slice_id, num_slots, length_of
        self.worker = FakeWorker(slice_id, num_slots, [self], length_of)
        self._seq, self._post_lock = 0, threading.Lock()
        self._halt = threading.Event()
        self.rejoins = 0
        self.rejoin_causes: list[str] = []  # why each rejoin happened, for a failing test's message
        self.outcome: str | None = None
        self.thread = threading.Thread(target=self._run, name=f"fake-slice-{slice_id}", daemon=True)

    # ------------------------------------------------------------------ posting
    def post_finished(self, slice_id, trajectories) -> None:
        """FakeWorker's sink: its finished trajectories, posted in order."""
        self.post([codec.trajectory_to_proto(t) for t in trajectories])

    def post(self, trajectories: list, seq: int | None = None) -> None:
        """Posts on this worker's session; `seq` None: the next number (a test's post then keeps
        the worker's own in sequence). Raises what the call raises."""
        with self._post_lock:
            if seq is None:
                self._seq += 1
                seq = self._seq
            request = pb.FinishedRequest(session=self.client.session, seq=seq, trajectories=trajectories)
            self.client.call("PostFinished", lambda t: self.client.stub.PostFinished(request, timeout=t))

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        while not self._halt.is_set():
            self.client.register(pb.ROLLOUT, HASH, slice_id=self.slice_id, num_slots=self.num_slots)
            with self._post_lock:
                self._seq = 0
            try:
                self.outcome = self._serve()
                return
            except (SessionLost, CallFailed, grpc.RpcError) as err:  # its session ended: join again
                if self._halt.is_set():
                    return
                self.rejoin_causes.append(f"{type(err).__name__}: {err}"[:200])
                self.worker = FakeWorker(self.slice_id, self.num_slots, [self], self._length_of)  # drops all
                self.rejoins += 1

    def _serve(self) -> str:
        stream = self.client.stub.Commands(pb.CommandsRequest(session=self.client.session))
        inbox: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(stream, inbox), daemon=True).start()
        last_beat = 0.0
        try:
            while not self._halt.is_set():
                if time.monotonic() - last_beat > TIMING.heartbeat_period_s:
                    self.client.stub.Heartbeat(pb.HeartbeatRequest(session=self.client.session), timeout=10)
                    last_beat = time.monotonic()
                while not inbox.empty():
                    item = inbox.get()
                    if isinstance(item, Exception):
                        raise item
                    command, arrays = item
                    if command.WhichOneof("kind") == "stop":
                        return f"stopped: {command.stop.reason}"
                    if command.WhichOneof("kind") != "keepalive":
                        self._execute(command, arrays)
                self.worker.tick()
                time.sleep(0.002)
            return "halted"
        finally:
            stream.cancel()

    @staticmethod
    def _read(stream, inbox: queue.Queue) -> None:
        try:
            for message, arrays in codec.FrameReader(iter(stream)):
                inbox.put((message, arrays))
            inbox.put(SessionLost("stream ended"))
        except grpc.RpcError as err:
            inbox.put(SessionLost(f"stream broke: {err.code().name}"))

    def _execute(self, command: pb.Command, arrays) -> None:
        kind = command.WhichOneof("kind")
        result = pb.Result(session=self.client.session, command_id=command.id)
        out_arrays = []
        try:
            if kind == "submit":
                self.worker.submit([codec.request_from_proto(r) for r in command.submit.requests])
            elif kind == "load_version":
                result.digest = self.worker.load_version(int(command.load_version.version))
            elif kind == "export":
                items = self.worker.export(list(command.export.traj_ids), kv=not command.export.without_kv)
                messages, out_arrays = codec.migratables_to_proto(items)
                result.exported.extend(messages)
            elif kind == "import_items":
                items = codec.migratables_from_proto(command.import_items.items, iter(arrays))
                result.reprefilled.extend(self.worker.import_(items) or [])
            elif kind == "progress":
                result.progress.extend(codec.request_to_proto(r) for r in self.worker.progress().values())
        except Exception as err:  # noqa: BLE001 - answered, as the real agent does
            result.error = f"{type(err).__name__}: {err}"
        self.client.call("Ack", lambda t: self.client.stub.Ack(codec.to_frames(result, out_arrays), timeout=t))

    def stop(self) -> None:
        self._halt.set()
        self.thread.join(timeout=10)
        self.client.close()


class RemoteRun:
    """A dora run of `slices` RemoteFakes behind the real service and Coordinator (vocabulary of
    2: the fakes' token id 1 is in it); with `held_out`, the trainer may ask for evaluation rounds."""

    def __init__(
        self,
        *,
        slices: int = 2,
        slots: int = 4,
        tbs: int = 8,
        rbs: int = 16,
        g: int = 4,
        seed: int = 0,
        held_out: HeldOut | None = None,
    ):
        self.log: list[str] = []
        self.service = CoordinatorService(
            Identity(HASH, dora_jax.__version__, slices, slots), TIMING, log=self.log.append
        )
        self.server, self.address = serve(self.service, SECRET)
        length_of = longtail(seed, median=4, cap=30)
        self.fakes = [RemoteFake(self.address, sid, slots, length_of) for sid in range(slices)]
        for fake in self.fakes:
            fake.thread.start()
        self.trainer = connect(self.address, auth.TRAINER)
        self.trainer.register(pb.TRAINER, HASH)
        self.trainer.stub.ReportPublished(pb.PublishedRequest(session=self.trainer.session, version=0), timeout=10)
        ports, version = self.service.wait_ready(30)
        self.ledger = Ledger(None)
        self.coord = Coordinator(
            config("dora", tbs=tbs, rbs=rbs, g=g, vocab_size=2),
            ports,
            prompts(),
            InstantScorer(),
            self.ledger,
            initial_version=version,
            on_slice_dropped=self.service.slice_dropped,
        )
        self.service.attach(self.coord, list(ports.values()), held_out=held_out)
        self.coord.start()
        self.version = version
        self.loop_error: list[BaseException] = []
        self._stop = threading.Event()
        self._loop = threading.Thread(target=self._process, name="coordinator", daemon=True)
        self._loop.start()

    def _process(self) -> None:
        try:
            while not self._stop.is_set():
                self.coord.process(timeout=0.005)
        except BaseException as err:
            traceback.print_exc()
            self.loop_error.append(err)

    def in_flight(self, slice_id: int) -> list:
        """The requests the coordinator has on `slice_id` now (read under its lock)."""
        with self.coord._cond:
            return [self.coord.requests[t] for t in self.coord.slice_trajs.get(slice_id, {})]

    def train_to(self, steps: int, timeout_s: float = 120.0, until: threading.Event | None = None) -> None:
        """Takes and publishes through the trainer's stub until version `steps` (or `until` is set)."""
        deadline = time.monotonic() + timeout_s
        session = self.trainer.session
        while self.version < steps and not (until is not None and until.is_set()):
            assert not self.loop_error, self.loop_error
            assert time.monotonic() < deadline, f"stuck at version {self.version}: {self.coord.stats}"
            reply = self.trainer.stub.TakeBatch(
                pb.TakeBatchRequest(session=session, trainer_version=self.version, wait_s=0.5), timeout=10
            )
            if reply.ready:
                self.version += 1
                published = pb.PublishedRequest(session=session, version=self.version)
                self.trainer.stub.ReportPublished(published, timeout=10)

    def training(self) -> _Training:
        """Trains on a thread (the workers get new work meanwhile) until the context exits."""
        return _Training(self)

    def close(self) -> None:
        self.service.stop("test over")
        for fake in self.fakes:
            fake.stop()
        self._stop.set()
        self._loop.join(timeout=10)
        self.coord.closed = True
        self.trainer.close()
        self.server.stop(0)


class _Training:
    def __init__(self, run: RemoteRun):
        self._run, self._done, self.error = run, threading.Event(), []
        self._thread = threading.Thread(target=self._train, name="trainer", daemon=True)

    def _train(self) -> None:
        try:
            self._run.train_to(10**9, timeout_s=600.0, until=self._done)
        except BaseException as err:
            self.error.append(err)

    def __enter__(self) -> _Training:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(timeout=30)
        assert not self.error, self.error
