"""The coordinator's gate against a real gRPC server: every method of the service descriptor has a
rule, and refuses a call with no token, a wrong token or a token of the wrong role before the
service sees it (its state unchanged); a rollout token acts for its own slice only; idle result
streams cannot starve Register and Heartbeat; oversized and hostile strings are refused and
logged bounded; KV tickets must name the slice's registered transfer server; TLS pins the CA."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

import dora_jax
from dora_jax.transport import auth, guard, tls
from dora_jax.transport import dora_pb2 as pb
from dora_jax.transport.client import Client, ClientTiming, Refused
from dora_jax.transport.service import PROTOCOL, CoordinatorService, Identity, Timing, make_server
from tests.transport.conftest import Sink

HASH = "5afe" * 16
SECRET = bytes(range(32))
METHODS = list(pb.DESCRIPTOR.services_by_name["Coordinator"].methods)


def _serve(log=None, **timing):
    service = CoordinatorService(
        Identity(HASH, dora_jax.__version__, 2, 4),
        Timing(heartbeat_period_s=0.05, **timing),
        log=log or (lambda m: None),
    )
    server, port = make_server(service, 0, host="127.0.0.1", auth=auth.Authenticator(SECRET, 2))
    sink = Sink()
    service.attach(sink)
    return service, server, f"127.0.0.1:{port}", sink


def _client(address, principal, secret=SECRET, **kw):
    timing = ClientTiming(call_timeout_s=5.0, unreachable_after_s=5.0, backoff_s=0.05)
    return Client(address, timing, auth.ClientCredentials(auth.role_token(secret, principal)), **kw)


def _raw_call(channel, method, token):
    """Calls `method` with an empty request (raw bytes, nothing parsed client side)."""
    path = f"/{guard.SERVICE}/{method.name}"
    metadata = [] if token is None else [(auth.TOKEN_METADATA, token)]
    if method.client_streaming:
        call = channel.stream_stream if method.server_streaming else channel.stream_unary
        result = call(path)(iter([b""]), metadata=metadata, timeout=5)
    else:
        call = channel.unary_stream if method.server_streaming else channel.unary_unary
        result = call(path)(b"", metadata=metadata, timeout=5)
    if method.server_streaming:
        list(result)
    return result


def _state(service, sink):
    return (
        dict(service._sessions),
        dict(service.ports),
        service._published,
        service.initial_version,
        service.resume_state,
        service.finished.is_set(),
        dict(sink.finished),
        list(sink.failed),
        list(sink.joined),
    )


def test_every_method_of_the_service_has_a_rule():
    assert {m.name for m in METHODS} == set(guard.METHOD_RULES)
    for rule in guard.METHOD_RULES.values():
        assert rule.callers and rule.callers <= guard.BOTH


def test_a_method_without_a_rule_is_refused_to_everyone():
    rules = {k: v for k, v in guard.METHOD_RULES.items() if k != "Heartbeat"}
    service = CoordinatorService(Identity(HASH, dora_jax.__version__, 1, 4), log=lambda m: None)
    server = grpc.server(
        __import__("concurrent.futures").futures.ThreadPoolExecutor(4),
        interceptors=[guard.Guard(auth.Authenticator(SECRET, 1), 1, log=lambda m: None, rules=rules)],
    )
    from dora_jax.transport import dora_pb2_grpc as pb_grpc

    pb_grpc.add_CoordinatorServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        with pytest.raises(grpc.RpcError) as err:
            _raw_call(channel, METHODS[1], auth.role_token(SECRET, auth.rollout(0)))
        assert METHODS[1].name == "Heartbeat" and err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        server.stop(0)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_every_method_refuses_no_token_a_wrong_token_and_the_wrong_role(method):
    log = []
    service, server, address, sink = _serve(log=log.append)
    rule = guard.METHOD_RULES[method.name]
    other = auth.TRAINER if auth.Kind.TRAINER not in rule.callers else auth.rollout(1)
    cases = {
        "none": (None, grpc.StatusCode.UNAUTHENTICATED),
        "forged": (auth.role_token(bytes(32), auth.TRAINER), grpc.StatusCode.UNAUTHENTICATED),
        "garbage": ("trainer." + "0" * 64, grpc.StatusCode.UNAUTHENTICATED),
        "no such slice": (auth.role_token(SECRET, auth.rollout(2)), grpc.StatusCode.UNAUTHENTICATED),
        "wrong role": (auth.role_token(SECRET, other), grpc.StatusCode.PERMISSION_DENIED),
    }
    try:
        before = _state(service, sink)
        channel = grpc.insecure_channel(address)
        for case, (token, code) in cases.items():
            if method.name == "Register" and case == "wrong role":
                continue  # both roles may register: a token's slice is checked below
            with pytest.raises(grpc.RpcError) as err:
                _raw_call(channel, method, token)
            assert err.value.code() == code, (case, err.value.details())
            assert err.value.details() in ("missing or invalid run token", "this role may not call this method")
        assert _state(service, sink) == before
        assert all(len(line) < 200 for line in log), log
    finally:
        server.stop(0)


def test_a_rollout_token_registers_and_uses_its_own_slice_only():
    service, server, address, sink = _serve()
    one, zero = _client(address, auth.rollout(1)), _client(address, auth.rollout(0))
    try:
        with pytest.raises(Refused, match="only its own role and slice"):
            one.register(pb.ROLLOUT, HASH, slice_id=0, num_slots=4)
        with pytest.raises(Refused, match="only its own role and slice"):
            one.register(pb.TRAINER, HASH)
        assert service.ports == {}
        session = zero.register(pb.ROLLOUT, HASH, slice_id=0, num_slots=4).session
        with pytest.raises(grpc.RpcError) as err:  # slice 0's session, slice 1's token
            one.stub.Heartbeat(pb.HeartbeatRequest(session=session), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and session[:8] not in err.value.details()
        zero.stub.Heartbeat(pb.HeartbeatRequest(session=session), timeout=5)
        trainer = _client(address, auth.TRAINER)
        assert trainer.register(pb.TRAINER, HASH).session
    finally:
        server.stop(0)


def test_idle_result_streams_do_not_block_register_or_heartbeat():
    """36 Ack streams that never send a frame: two are held (its per-caller cap) until
    first_frame_s cancels them, the others are refused at once; Register and Heartbeat answer."""
    service, server, address, sink = _serve(first_frame_s=1.0)
    attacker = _client(address, auth.rollout(0))
    never = threading.Event()

    def idle_frames():
        never.wait(30)
        return
        yield

    codes, threads = [], []
    for _ in range(36):

        def ack():
            try:
                attacker.stub.Ack(idle_frames(), timeout=30)
                codes.append("ok")
            except grpc.RpcError as err:
                codes.append(err.code())

        threads.append(threading.Thread(target=ack, daemon=True))
        threads[-1].start()
    try:
        time.sleep(0.5)
        start = time.monotonic()
        worker = _client(address, auth.rollout(1))
        session = worker.register(pb.ROLLOUT, HASH, slice_id=1, num_slots=4).session
        worker.stub.Heartbeat(pb.HeartbeatRequest(session=session), timeout=5)
        assert time.monotonic() - start < 3.0
        for thread in threads:
            thread.join(timeout=10)
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 34, codes
        assert codes.count(grpc.StatusCode.CANCELLED) == 2, codes  # cut at first_frame_s
    finally:
        never.set()
        server.stop(0)


def test_a_huge_or_forging_host_string_is_refused_and_logged_bounded():
    log = []
    service, server, address, sink = _serve(log=log.append)
    client = _client(address, auth.rollout(0))
    try:
        request = dict(role=pb.ROLLOUT, slice_id=0, num_slots=4, config_hash=HASH, protocol=PROTOCOL)
        request["package_version"] = dora_jax.__version__
        with pytest.raises(grpc.RpcError) as err:
            client.stub.Register(pb.RegisterRequest(host="x" * (1 << 20), **request), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bytes exceeds" in err.value.details()
        forged = "vm\n[coordinator] the trainer has finished its steps" + "y" * 2000
        with pytest.raises(grpc.RpcError) as err:
            client.stub.Register(pb.RegisterRequest(host=forged, **request), timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "longer than 255" in err.value.details()
        assert service.ports == {} and len(log) == 2
        assert all(len(line) < 200 and "\n" not in line for line in log), log
        assert "\\n[coordinator]" in log[1]  # escaped: no forged line
    finally:
        server.stop(0)


def test_refusals_show_none_of_the_coordinators_values():
    service, server, address, sink = _serve()
    client = _client(address, auth.rollout(0))
    try:
        with pytest.raises(Refused) as err:
            client.register(pb.ROLLOUT, "0123456789ab" * 4, slice_id=0, num_slots=4)
        assert "0123456789ab" in str(err.value) and HASH[:6] not in str(err.value)
        bad = pb.RegisterRequest(role=pb.TRAINER, config_hash=HASH, package_version="0.0.1", protocol=PROTOCOL)
        with pytest.raises(grpc.RpcError) as err:
            _client(address, auth.TRAINER).stub.Register(bad, timeout=5)
        assert "'0.0.1' differs" in err.value.details() and dora_jax.__version__ not in err.value.details()
        client.register(pb.ROLLOUT, HASH, slice_id=0, num_slots=4)
        stream = client.stub.Commands(pb.CommandsRequest(session=client.session))
        next(iter(stream), None)  # the stream opens: the slice is live
        with pytest.raises(grpc.RpcError) as err:  # a second worker for a live slice
            _client(address, auth.rollout(0)).stub.Register(
                pb.RegisterRequest(
                    role=pb.ROLLOUT,
                    slice_id=0,
                    num_slots=4,
                    config_hash=HASH,
                    package_version=dora_jax.__version__,
                    protocol=PROTOCOL,
                ),
                timeout=5,
            )
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS and client.session[:8] not in err.value.details()
        stream.cancel()
    finally:
        server.stop(0)


def test_a_kv_ticket_must_name_the_slices_registered_transfer_server():
    service, server, address, sink = _serve()
    client = _client(address, auth.rollout(0))
    try:
        session = client.register(pb.ROLLOUT, HASH, slice_id=0, num_slots=4, transfer_address="10.0.0.5:8480").session
        stream = client.stub.Commands(pb.CommandsRequest(session=session))
        next(iter(stream), None)
        forged = pb.SlotState(
            kv_ticket=pb.KVTicket(address="10.6.6.6:1", uuid=7), rng_key=pb.Array(dtype="uint32", shape=[2])
        )
        result = pb.Result(session=session, command_id=1, exported=[pb.Migratable(slot_state=forged)])
        with pytest.raises(grpc.RpcError) as err:
            client.stub.Ack(iter([pb.Frame(result=result)]), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not the transfer server" in err.value.details()
        assert sink.failed and "KV ticket names '10.6.6.6:1'" in sink.failed[0][1]
        stream.cancel()
    finally:
        server.stop(0)


def test_tls_pins_the_runs_ca(tmp_path):
    made = auth.make_run_credentials(str(tmp_path / "auth"), 1, tls=True)
    env = made.environment(None)
    server_tls = auth.load_server_tls(env)
    service = CoordinatorService(Identity(HASH, dora_jax.__version__, 1, 4), log=lambda m: None)
    secret = auth.load_secret(env)
    server, port = make_server(service, 0, host="127.0.0.1", auth=auth.Authenticator(secret, 1), tls=server_tls)
    address = f"127.0.0.1:{port}"
    timing = ClientTiming(call_timeout_s=2.0, unreachable_after_s=2.0, backoff_s=0.05)
    try:
        good = Client(address, timing, auth.client_credentials(made.environment(auth.TRAINER)))
        assert good.register(pb.TRAINER, HASH).session
        other_ca = tls.make_ca_and_server_cert()[0]
        token = auth.load_token(made.environment(auth.TRAINER))
        with pytest.raises(Exception, match="unreachable|UNAVAILABLE"):  # the handshake fails: another CA
            Client(address, timing, auth.ClientCredentials(token, other_ca)).register(pb.TRAINER, HASH)
        with pytest.raises(Exception, match="unreachable|UNAVAILABLE"):  # plaintext to a TLS port
            Client(address, timing, auth.ClientCredentials(token)).register(pb.TRAINER, HASH)
    finally:
        server.stop(0)
