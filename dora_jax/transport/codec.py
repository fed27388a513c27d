"""Records <-> protobuf messages, and messages with arrays <-> streams of frames.

Numpy arrays never sit inside a message (dora.proto explains why): `encode_*` return the message
plus the list of arrays it announces, in order; `to_frames` sends the message then those arrays'
bytes in chunks of at most `chunk_bytes`; `FrameReader` reads them back into fresh numpy buffers.
Every conversion is exact: token ids, log-probs (float64 on the wire, as Python floats are) and
array bytes come back bit-identical.

An array crosses the wire as its raw little-endian bytes and its dtype's name, from an allow-list
of plain numeric types (`WIRE_DTYPES`: bool, ints, floats, bfloat16; never object, whose "bytes"
are pointers). A reader is handed frames by a peer it does not trust: it checks each announced
array's dtype, rank and size against the allow-list and its byte limit before it allocates.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import ml_dtypes
import numpy as np

from dora_jax.coordinator.ports import Migratable
from dora_jax.core.records import (
    FinishReason,
    Group,
    KVTicket,
    Reprefill,
    Request,
    SamplingParams,
    ScoredTrajectory,
    SlotState,
    Trajectory,
)
from dora_jax.transport import dora_pb2 as pb

DEFAULT_CHUNK_BYTES = 1 << 20  # well under gRPC's default 4 MiB message limit
# What one message's arrays may hold in all, unless the reader is given another limit: a slot's KV
# rows of the largest config (30B: 48 layers x 32k rows x 4 heads x 128 x 2 bytes, k and v) fit.
DEFAULT_MAX_ARRAY_BYTES = 16 << 30
MAX_RANK = 8  # KV rows are rank 4, RNG keys rank 1

# The dtypes an array may have on the wire, by the name the wire gives them (little-endian).
WIRE_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(ml_dtypes.bfloat16 if name == "bfloat16" else name).newbyteorder("<")
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
    )
}


# ---------------------------------------------------------------- requests and trajectories
def request_to_proto(request: Request) -> pb.Request:
    s = request.sampling
    return pb.Request(
        traj_id=request.traj_id,
        group_id=request.group_id,
        prompt_id=request.prompt_id,
        prompt_ids=request.prompt_ids,
        version=request.version,
        max_new_tokens=request.max_new_tokens,
        sampling=pb.Sampling(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed),
        stop_ids=request.stop_ids,
        has_forced_length=request.forced_length is not None,
        forced_length=request.forced_length or 0,
        prefix_response_ids=request.prefix_response_ids,
        prefix_logprobs=request.prefix_logprobs,
        prefix_versions=request.prefix_versions,
    )


def request_from_proto(m: pb.Request) -> Request:
    s = m.sampling
    return Request(
        traj_id=m.traj_id,
        group_id=m.group_id,
        prompt_id=m.prompt_id,
        prompt_ids=tuple(m.prompt_ids),
        version=int(m.version),
        max_new_tokens=int(m.max_new_tokens),
        sampling=SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=int(s.top_k), seed=int(s.seed)),
        stop_ids=tuple(m.stop_ids),
        forced_length=int(m.forced_length) if m.has_forced_length else None,
        prefix_response_ids=tuple(m.prefix_response_ids),
        prefix_logprobs=tuple(m.prefix_logprobs),
        prefix_versions=tuple(int(v) for v in m.prefix_versions),
    )


def trajectory_to_proto(t: Trajectory) -> pb.Trajectory:
    return pb.Trajectory(
        traj_id=t.traj_id,
        group_id=t.group_id,
        prompt_id=t.prompt_id,
        prompt_ids=t.prompt_ids,
        response_ids=t.response_ids,
        logprobs=t.logprobs,
        version=t.version,
        versions_seen=t.versions_seen,
        finish_reason=t.finish_reason.value,
        slice_id=t.slice_id,
        has_error=t.error is not None,
        error=t.error or "",
        dispatch_t=t.dispatch_t,
        finish_t=t.finish_t,
        num_migrations=t.num_migrations,
        decode_s=t.decode_s,
        has_behaviour=t.behaviour_logprobs is not None,
        behaviour_logprobs=t.behaviour_logprobs or (),
        behaviour_digest=t.behaviour_digest or "",
    )


def trajectory_from_proto(m: pb.Trajectory) -> Trajectory:
    return Trajectory(
        traj_id=m.traj_id,
        group_id=m.group_id,
        prompt_id=m.prompt_id,
        prompt_ids=tuple(m.prompt_ids),
        response_ids=tuple(m.response_ids),
        logprobs=tuple(m.logprobs),
        version=int(m.version),
        versions_seen=tuple(int(v) for v in m.versions_seen),
        finish_reason=FinishReason(m.finish_reason),
        slice_id=int(m.slice_id),
        error=m.error if m.has_error else None,
        dispatch_t=m.dispatch_t,
        finish_t=m.finish_t,
        num_migrations=int(m.num_migrations),
        decode_s=m.decode_s,
        behaviour_logprobs=tuple(m.behaviour_logprobs) if m.has_behaviour else None,
        behaviour_digest=m.behaviour_digest if m.has_behaviour else None,
    )


def group_to_proto(g: Group) -> pb.Group:
    samples = [
        pb.ScoredTrajectory(
            trajectory=trajectory_to_proto(s.trajectory),
            reward=s.reward,
            has_reward_error=s.reward_error is not None,
            reward_error=s.reward_error or "",
        )
        for s in g.samples
    ]
    return pb.Group(group_id=g.group_id, version=g.version, samples=samples)


def group_from_proto(m: pb.Group) -> Group:
    samples = tuple(
        ScoredTrajectory(trajectory_from_proto(s.trajectory), s.reward, s.reward_error if s.has_reward_error else None)
        for s in m.samples
    )
    return Group(m.group_id, int(m.version), samples)


# ---------------------------------------------------------------- slot states (arrays out of band)
def _array_header(a) -> pb.Array:
    return pb.Array(dtype=dtype_name(a.dtype), shape=a.shape)


def dtype_name(dtype) -> str:
    """A dtype as the wire names it ("float32", "bfloat16"); a ValueError for one off the allow-list."""
    d = np.dtype(dtype)
    if d.name not in WIRE_DTYPES:
        raise ValueError(f"dtype {d} cannot cross the wire; expected one of {sorted(WIRE_DTYPES)}")
    return d.name


def dtype_of(name: str) -> np.dtype:
    """The (little-endian) dtype the wire names `name`; a ValueError for a name off the allow-list."""
    dtype = WIRE_DTYPES.get(name)
    if dtype is None:
        raise ValueError(f"array dtype {name[:32]!r} is not allowed; expected one of {sorted(WIRE_DTYPES)}")
    return dtype


def checked_shape(header: pb.Array, limit_bytes: int) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, bytes) of an announced array, checked before anything is allocated: the
    dtype on the allow-list, rank <= MAX_RANK, no negative dimension, at most `limit_bytes`."""
    dtype = dtype_of(header.dtype)
    shape = tuple(int(n) for n in header.shape)
    if len(shape) > MAX_RANK or any(n < 0 for n in shape):
        raise ValueError(f"array shape {shape[: MAX_RANK + 1]} is not allowed; expected rank <= {MAX_RANK}, sizes >= 0")
    nbytes = dtype.itemsize
    for n in shape:  # Python ints: no overflow, and stop as soon as the limit is passed
        nbytes *= n
        if nbytes > limit_bytes:
            raise ValueError(f"a {header.dtype} array of shape {shape} exceeds the {limit_bytes}-byte limit")
    return shape, dtype, nbytes


def _wire_bytes(array) -> memoryview:
    """The array's bytes as they cross the wire (little-endian, C order), whatever its dtype kind:
    numpy cannot export an ml_dtypes array (bfloat16) as a buffer, so it goes as raw uint8."""
    a = np.asarray(array)
    wire = WIRE_DTYPES[dtype_name(a.dtype)]
    return memoryview(np.ascontiguousarray(a, dtype=wire).reshape(-1).view(np.uint8))


def slot_state_to_proto(state: SlotState) -> tuple[pb.SlotState, list[np.ndarray]]:
    """The message and the arrays whose bytes follow it: k, v and rng_key, or with a `kv_ticket`
    only rng_key (k and v are pulled from the ticket's server; the message gives their shapes)."""
    ticket = state.kv_ticket
    kv = () if ticket else (np.ascontiguousarray(state.k_LSKD), np.ascontiguousarray(state.v_LSKD))
    arrays = [*kv, np.ascontiguousarray(state.rng_key)]
    m = pb.SlotState(
        request=request_to_proto(state.request),
        k=_array_header(state.k_LSKD),
        v=_array_header(state.v_LSKD),
        position=state.position,
        last_token=state.last_token,
        response_ids=state.response_ids,
        logprobs=state.logprobs,
        token_versions=state.token_versions,
        rng_key=_array_header(arrays[-1]),
        version=state.version,
        kv_ticket=pb.KVTicket(address=ticket.address, uuid=ticket.uuid) if ticket else None,
    )
    return m, arrays


def slot_state_from_proto(m: pb.SlotState, arrays: Iterator[np.ndarray]) -> SlotState:
    """A SlotState; with a kv_ticket its k and v are ShapeDtypeStructs until pulled."""
    ticket = KVTicket(m.kv_ticket.address, int(m.kv_ticket.uuid)) if m.HasField("kv_ticket") else None
    if ticket:
        import jax  # only a ticket's receiver needs it

        k, v = (jax.ShapeDtypeStruct(tuple(a.shape), dtype_of(a.dtype)) for a in (m.k, m.v))
    else:
        k, v = next(arrays), next(arrays)
    rng = next(arrays)
    return SlotState(
        request=request_from_proto(m.request),
        k_LSKD=k,
        v_LSKD=v,
        position=int(m.position),
        last_token=int(m.last_token),
        response_ids=tuple(m.response_ids),
        logprobs=tuple(m.logprobs),
        token_versions=tuple(int(x) for x in m.token_versions),
        rng_key=rng,
        version=int(m.version),
        kv_ticket=ticket,
    )


def migratables_to_proto(items: Sequence[Migratable]) -> tuple[list[pb.Migratable], list[np.ndarray]]:
    out, arrays = [], []
    for item in items:
        if isinstance(item, SlotState):
            m, a = slot_state_to_proto(item)
            out.append(pb.Migratable(slot_state=m))
            arrays += a
        elif isinstance(item, Reprefill):
            out.append(pb.Migratable(reprefill=request_to_proto(item.request)))
        elif isinstance(item, Request):
            out.append(pb.Migratable(request=request_to_proto(item)))
        else:
            raise TypeError(f"cannot migrate a {type(item).__name__}; expected SlotState, Reprefill or Request")
    return out, arrays


def migratables_from_proto(items: Iterable[pb.Migratable], arrays: Iterator[np.ndarray]) -> list[Migratable]:
    def one(m: pb.Migratable) -> Migratable:
        kind = m.WhichOneof("item")
        if kind == "slot_state":
            return slot_state_from_proto(m.slot_state, arrays)
        return Reprefill(request_from_proto(m.reprefill)) if kind == "reprefill" else request_from_proto(m.request)

    return [one(m) for m in items]


def announced_arrays(message) -> list[pb.Array]:
    """The Array headers a Command or Result announces, in stream order."""
    items = ()
    if isinstance(message, pb.Command) and message.WhichOneof("kind") == "import_items":
        items = message.import_items.items
    elif isinstance(message, pb.Result):
        items = message.exported
    headers = []
    for item in items:
        if item.HasField("slot_state"):
            state = item.slot_state
            kv = [] if state.HasField("kv_ticket") else [state.k, state.v]
            headers += [*kv, state.rng_key]
    return headers


# ---------------------------------------------------------------- frames
def to_frames(message, arrays: Sequence[np.ndarray], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[pb.Frame]:
    """The message (a Command or a Result) as one frame, then its arrays' bytes in chunks."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes={chunk_bytes}; expected >= 1")
    field = "command" if isinstance(message, pb.Command) else "result"
    yield pb.Frame(**{field: message})
    for array in arrays:
        view = _wire_bytes(array)
        for start in range(0, len(view), chunk_bytes):
            yield pb.Frame(chunk=bytes(view[start : start + chunk_bytes]))


class FrameReader:
    """Reads (message, arrays) pairs off a frame iterator: a message, then exactly the bytes of the
    arrays it announces. A chunk with no message before it, a stream that ends mid-array, or an
    array whose dtype or size is not allowed (checked before allocating; at most
    `max_array_bytes` for one message's arrays) is a `ValueError` naming what was expected.

    `next_message()` and `read_arrays(message)` split the two steps, so a server checks who sent
    the message before it reads (and allocates for) a single array byte."""

    def __init__(self, frames: Iterator[pb.Frame], max_array_bytes: int = DEFAULT_MAX_ARRAY_BYTES):
        self._frames = frames
        self._max_bytes = max_array_bytes

    def __iter__(self):
        return self

    def __next__(self) -> tuple[object, list[np.ndarray]]:
        message = self.next_message()  # StopIteration ends the stream cleanly between messages
        return message, self.read_arrays(message)

    def next_message(self):
        """The next message (Command or Result); its arrays are not read yet."""
        frame = next(self._frames)
        kind = frame.WhichOneof("body")
        if kind == "chunk" or kind is None:
            raise ValueError("stream out of step: got an array chunk where a message was expected")
        return getattr(frame, kind)

    def read_arrays(self, message) -> list[np.ndarray]:
        """The arrays `message` announces, read off the stream once all of them are checked."""
        budget, checked = self._max_bytes, []
        for header in announced_arrays(message):
            shape, dtype, nbytes = checked_shape(header, budget)
            budget -= nbytes
            checked.append((header, shape, dtype, nbytes))
        return [self._read_array(*c) for c in checked]

    def _read_array(self, header: pb.Array, shape: tuple[int, ...], dtype: np.dtype, nbytes: int) -> np.ndarray:
        raw = np.empty(nbytes, np.uint8)  # filled as raw bytes, viewed as `dtype` (bfloat16 too)
        filled = 0
        while filled < nbytes:
            try:
                frame = next(self._frames)
            except StopIteration:
                raise ValueError(
                    f"stream ended after {filled} of {nbytes} bytes of a {header.dtype} array {shape}"
                ) from None
            if frame.WhichOneof("body") != "chunk":
                raise ValueError(
                    f"stream out of step: got a {frame.WhichOneof('body')} after {filled} of {nbytes} bytes of an array"
                )
            piece = frame.chunk
            if filled + len(piece) > nbytes:
                raise ValueError(f"array chunk overruns its {nbytes}-byte array")
            raw[filled : filled + len(piece)] = np.frombuffer(piece, np.uint8)
            filled += len(piece)
        return raw.view(dtype).reshape(shape)
