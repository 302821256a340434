"""The wire contract between router, prefill nodes and decode nodes.

Every process must agree on exactly what travels, so every message type, its
tag and the protocol version live here and nowhere else; the only logic is
encode / decode / validate. docs/protocol.md is the prose version.

Wire form: one multipart message ``[header, frame_1, ..., frame_n]``. The
header is a MessagePack map ``{"v", "t", <fields>, "tensors": [meta, ...]}``;
each tensor is its own raw frame, so a multi-GB KV transfer is neither copied
into msgpack nor pickled, and the receiver rebuilds tensors over the received
frame buffers without a copy. Times are relative durations in seconds
(``*_s``): clocks differ between machines.

Decoding never trusts the peer: anything malformed raises ``ProtocolError``
with a message naming the offending field, so the receiver can answer with an
``Error`` message and keep serving.
"""
import dataclasses
import math
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Sequence, Union

import msgpack
import torch
import xxhash

PROTOCOL_VERSION = 3  # 2: Hello.incarnation, Welcome.router_incarnation, SamplingSpec.seed_offset,
                      # decode-side prefix reuse (cached_blocks / skip_blocks / first_block)
                      # 3: same-host KV through shared memory (Hello.host_id,
                      # PrefillRequest.decode_host_id, KVChunk.shm); logprobs
                      # (SamplingSpec.logprobs/prompt_logprobs, Logprobs in FirstToken and
                      # TokenItem); SamplingSpec min_tokens, penalties, logit_bias, guide
MAX_HEADER_BYTES = 16 * 1024 * 1024  # a header is metadata; KV travels in frames
# Decoded MessagePack may hold at most one container (map or array) per this many bytes of
# input: a header of empty maps ({} is 1 byte, a dict 64) cannot grow 70x in memory.
BYTES_PER_CONTAINER = 16
MIN_CONTAINERS = 256
MAX_SEED = 2**63        # seeds are in [0, 2^63): a signed 64-bit value on every side
MAX_WIRE_INT = 2**63    # the most any count or id on the wire may be (msgpack packs up to 2^64)
MAX_HOST_ID = 256       # Hello.host_id: boot id + /dev/shm identity

# Error codes: the `code` of ProtocolError and of the Error message.
BAD_MESSAGE = "bad_message"
VERSION_MISMATCH = "version_mismatch"
UNKNOWN_TYPE = "unknown_type"
UNEXPECTED_TYPE = "unexpected_type"
TOO_LARGE = "too_large"
LAYOUT_MISMATCH = "layout_mismatch"
MODEL_MISMATCH = "model_mismatch"
CHECKSUM_MISMATCH = "checksum_mismatch"
NO_CAPACITY = "no_capacity"
LEASE_EXPIRED = "lease_expired"
TIMEOUT = "timeout"
ABORTED = "aborted"
INTERNAL = "internal"
UNREACHABLE = "unreachable"  # a peer's address cannot be connected to
ERROR_CODES = (BAD_MESSAGE, VERSION_MISMATCH, UNKNOWN_TYPE, UNEXPECTED_TYPE, TOO_LARGE,
               LAYOUT_MISMATCH, MODEL_MISMATCH, CHECKSUM_MISMATCH, NO_CAPACITY,
               LEASE_EXPIRED, TIMEOUT, ABORTED, INTERNAL, UNREACHABLE)

ROLES = ("prefill", "decode", "colocated")

# Wire dtype names (also used by KVLayout.dtype) -> torch dtype.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8,
}
_DTYPE_NAMES = {dt: name for name, dt in DTYPES.items()}

FrameLike = Any  # bytes | bytearray | memoryview | zmq.Frame (anything with .buffer)


class ProtocolError(Exception):
    """A message that breaks the contract. ``peer`` is the ROUTER identity, if known."""

    def __init__(self, code: str, message: str, *, peer: Optional[bytes] = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.peer = peer

    def to_message(self, req_id: Optional[str] = None) -> "Error":
        """The ``Error`` to send back, so the peer learns what it did wrong."""
        return Error(req_id=req_id, code=self.code, message=self.message)


class Message:
    """Base of every top-level wire message; ``TAG`` is its ``"t"`` on the wire."""

    TAG: ClassVar[str] = ""

    def _validate(self) -> None:
        """Cross-field checks beyond field types; run on encode and on decode."""


MESSAGE_TYPES: dict[str, type] = {}
_struct = dataclass(frozen=True, kw_only=True)


def _message(tag: str):
    def register(cls):
        cls = _struct(cls)
        names = {f.name for f in dataclasses.fields(cls)}
        assert tag not in MESSAGE_TYPES and not names & {"v", "t"}, (tag, names)
        cls.TAG = tag
        MESSAGE_TYPES[tag] = cls
        return cls
    return register


# ---------------------------------------------------------------- nested types

@_struct
class KVLayout:
    """Shape of a node's paged KV cache; prefill and decode must match exactly."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # a key of DTYPES
    block_size: int


@_struct
class ModelIdentity:
    """Which model a node serves; config_hash covers config.json + weight file names/sizes."""
    name: str
    config_hash: str


@_struct
class NodeStats:
    """A node's load, sent as data so the router can decide from it."""
    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    queued_prompt_tokens: int


@_struct
class LogitBias:
    """A number added to one token's logit before sampling."""
    token_id: int
    bias: float


@_struct
class GuideSpec:
    """Structured output: kind (engine/grammar.py GUIDE_KINDS: json, json_object, regex,
    choice, grammar) and its spec (a JSON schema, a regex, a JSON array of choices, a Lark
    grammar); nodes compile it with the model's vocabulary, cached by (kind, spec)."""
    kind: str
    spec: str


@_struct
class SamplingSpec:
    """Sampling parameters as nodes see them (stop strings stay in the router)."""
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: Optional[int] = None
    stop_token_ids: list[int]
    ignore_eos: bool
    # Tokens this request already sampled in earlier attempts (failover): a seeded request's
    # random stream resumes at this index instead of starting over.
    seed_offset: int = 0
    # Logprobs to compute (None: none): of each sampled token with this many alternatives,
    # and of each prompt token (on the prefill node) with prompt_logprobs alternatives.
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None

    # Logits processing (vLLM's meanings; engine/logits_processors.py). Output tokens of
    # earlier attempts are the last seed_offset tokens of the prompt sent.
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: list[LogitBias] = field(default_factory=list)
    guide: Optional[GuideSpec] = None


@_struct
class Logprobs:
    """Logprobs of consecutive tokens of one request under the model's raw distribution
    (log_softmax of the unprocessed logits): for token i its own logprob, and the ids and
    logprobs of the k most likely tokens at its position, most likely first."""
    token_logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@_struct
class PrefillRequest:
    """One request of a PrefillBatch, with where its KV must go."""
    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    decode_node_id: str
    kv_address: str
    timeout_s: float
    skip_blocks: int = 0  # leading KV blocks the decode node holds already: not sent
    decode_host_id: str = ""  # the decode node's Hello.host_id: equal to ours, KV goes via shm


@_struct
class ShmKV:
    """Where a KVChunk's pages lie in the sender's shared-memory segment (same host)."""
    segment: str           # file name under /dev/shm
    offsets: list[int]     # byte offset of each tensor's page pool, in tensor-name order
    block_ids: list[int]   # the sender's pages of the request, in the request's order


@_struct
class FirstToken:
    """The first sampled token of one request (its TTFT)."""
    req_id: str
    token_id: int
    finish_reason: Optional[str] = None
    logprobs: Optional[Logprobs] = None          # of token_id, when the request asked
    prompt_logprobs: Optional[Logprobs] = None   # of prompt tokens 1.., when it asked


@_struct
class TokenItem:
    """New tokens of one request from one decode step."""
    req_id: str
    token_ids: list[int]
    finish_reason: Optional[str] = None
    logprobs: Optional[Logprobs] = None  # of token_ids, when the request asked


# ---------------------------------------------------------------- messages

@_message("hello")
class Hello(Message):
    """node -> router: join the cluster (first message on the control socket)."""
    node_id: str
    role: str  # one of ROLES
    protocol_version: int
    model: ModelIdentity
    kv_layout: KVLayout
    capacity: NodeStats
    kv_address: Optional[str] = None  # decode nodes: where prefill nodes connect
    pid: int
    compute: str = "model"  # "none": a benchmark node that skips the forward (fixed tokens)
    # Random per process start: the same id again after a silence is a resync (the router
    # stalled), a new one a restart (its work is gone).
    incarnation: str = ""
    # Boot id + /dev/shm identity ("" unknown): nodes with equal ids share memory.
    host_id: str = ""

    def _validate(self) -> None:
        if self.role not in ROLES:
            raise ProtocolError(BAD_MESSAGE, f"Hello.role: {self.role!r} is not one of {ROLES}")
        if len(self.host_id) > MAX_HOST_ID:
            raise ProtocolError(BAD_MESSAGE, f"Hello.host_id: {len(self.host_id)} characters, "
                                f"at most {MAX_HOST_ID}")


@_message("welcome")
class Welcome(Message):
    """router -> node: answer to Hello; heartbeat every interval, dead after `liveness` misses."""
    accepted: bool
    reason: str
    heartbeat_interval_s: float
    liveness: int
    router_incarnation: str = ""  # a node welcomed again by the same router keeps its work


@_message("heartbeat")
class Heartbeat(Message):
    """both ways: I am alive (any message counts as one too); nodes attach stats."""
    node_id: str
    stats: Optional[NodeStats] = None


@_message("prefill_batch")
class PrefillBatch(Message):
    """router -> prefill: requests to prefill in one forward."""
    requests: list[PrefillRequest]


@_message("first_tokens")
class FirstTokens(Message):
    """prefill -> router: first token of each prefilled request."""
    items: list[FirstToken]


@_message("reserve")
class Reserve(Message):
    """router -> decode: hold KV blocks for a request for lease_s seconds."""
    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    prefill_node_id: str
    lease_s: float
    timeout_s: float = 0.0  # the request's time left; the node ends it past that (0: none)


@_message("reserve_reply")
class ReserveReply(Message):
    """decode -> router: whether the blocks were reserved, and how many; of those, how
    many leading ones the decode node had cached (their KV need not be sent)."""
    req_id: str
    ok: bool
    reason: str
    num_blocks: int
    cached_blocks: int = 0


@_message("kv_chunk")
class KVChunk(Message):
    """prefill -> decode (KV socket): KV of layers [layer_start, layer_end) of one request.

    Tensors "k{layer}" / "v{layer}", each [num_blocks, block_size, num_kv_heads,
    head_dim] in kv_layout.dtype, num_blocks = ceil(num_tokens / block_size) -
    first_block: the leading first_block blocks are the decode node's cached ones.
    checksums: checksum_of each tensor frame in ``tensors`` order, or empty.
    """
    req_id: str
    model: ModelIdentity
    kv_layout: KVLayout
    layer_start: int
    layer_end: int
    num_tokens: int
    first_block: int = 0
    checksums: list[int] = field(default_factory=list)
    last: bool
    first_token: Optional[int] = None  # set on the last chunk
    shm: Optional[ShmKV] = None  # same host: the pages are there, not in tensor frames
    tensors: dict[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def _validate(self) -> None:
        lay, where = self.kv_layout, f"KVChunk {self.req_id!r}"
        if lay.dtype not in DTYPES:
            raise ProtocolError(BAD_MESSAGE, f"{where}: kv_layout.dtype {lay.dtype!r} is not one "
                                f"of {list(DTYPES)}")
        if not 0 <= self.layer_start < self.layer_end <= lay.num_layers:
            raise ProtocolError(BAD_MESSAGE, f"{where}: layers [{self.layer_start}, "
                                f"{self.layer_end}) not inside [0, {lay.num_layers})")
        if self.num_tokens <= 0 or lay.block_size <= 0:
            raise ProtocolError(BAD_MESSAGE, f"{where}: num_tokens={self.num_tokens} and "
                                f"block_size={lay.block_size} must be positive")
        names = kv_tensor_names(self.layer_start, self.layer_end)
        if self.shm is None and sorted(self.tensors) != sorted(names):
            raise ProtocolError(BAD_MESSAGE, f"{where}: tensors {list(self.tensors)}, "
                                f"expected {names}")
        num_blocks = -(-self.num_tokens // lay.block_size) - self.first_block
        if not 0 <= self.first_block < num_blocks + self.first_block:
            raise ProtocolError(BAD_MESSAGE, f"{where}: first_block={self.first_block} leaves "
                                "no block of the prompt to send")
        if self.shm is not None:
            self._validate_shm(where, len(names), num_blocks)
        shape = (num_blocks, lay.block_size, lay.num_kv_heads, lay.head_dim)
        for name, t in self.tensors.items():
            if tuple(t.shape) != shape or t.dtype != DTYPES[lay.dtype]:
                raise ProtocolError(BAD_MESSAGE, f"{where}: tensor {name!r} is {list(t.shape)} "
                                    f"{t.dtype}, expected {list(shape)} {lay.dtype}")
        if len(self.checksums) not in (0, len(names)):
            raise ProtocolError(BAD_MESSAGE, f"{where}: {len(self.checksums)} checksums for "
                                f"{len(names)} tensors")
        if self.first_token is not None and not self.last:
            raise ProtocolError(BAD_MESSAGE, f"{where}: first_token set on a chunk that is "
                                "not last")

    def _validate_shm(self, where: str, num_tensors: int, num_blocks: int) -> None:
        shm = self.shm
        if self.tensors:
            raise ProtocolError(BAD_MESSAGE, f"{where}: carries tensor frames and shm; one "
                                "or the other")
        if len(shm.offsets) != num_tensors or len(shm.block_ids) != num_blocks:
            raise ProtocolError(BAD_MESSAGE, f"{where}: shm has {len(shm.offsets)} offsets and "
                                f"{len(shm.block_ids)} block ids, expected {num_tensors} and "
                                f"{num_blocks}")
        if any(not 0 <= v < MAX_WIRE_INT for v in (*shm.offsets, *shm.block_ids)):
            raise ProtocolError(BAD_MESSAGE, f"{where}: shm offsets and block ids must be in "
                                f"[0, 2^63)")


def kv_tensor_names(layer_start: int, layer_end: int) -> list[str]:
    """A KVChunk's tensors, in wire order: k{l}, v{l} for each layer l."""
    return [f"{kv}{i}" for i in range(layer_start, layer_end) for kv in "kv"]


@_message("kv_ack")
class KVAck(Message):
    """decode -> prefill (KV socket): the request's KV arrived whole (ok) or not (reason)."""
    req_id: str
    ok: bool
    reason: str


@_message("token_batch")
class TokenBatch(Message):
    """decode -> router: the tokens of one decode step, all requests together."""
    items: list[TokenItem]


@_message("abort")
class Abort(Message):
    """router -> node: forget these requests (client gone, deadline, failover)."""
    req_ids: list[str]
    reason: str


@_message("error")
class Error(Message):
    """any direction: something failed; code is one of ERROR_CODES."""
    req_id: Optional[str] = None
    code: str
    message: str


@_message("drain")
class Drain(Message):
    """router -> node: take no new work; node -> router: I am draining."""
    reason: str


@_message("bye")
class Bye(Message):
    """node -> router: leaving the cluster on purpose."""
    node_id: str
    reason: str


# ---------------------------------------------------------------- tensors

def _as_bytes_view(frame: FrameLike) -> memoryview:
    """A flat byte view of a frame, without copying (zmq.Frame exposes .buffer)."""
    try:
        view = memoryview(getattr(frame, "buffer", frame))
    except TypeError:
        raise ProtocolError(BAD_MESSAGE, f"frame of type {type(frame).__name__} is not a "
                            "buffer") from None
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def checksum_of(buffer: Union[FrameLike, torch.Tensor]) -> int:
    """64-bit XXH3 of a frame or of a tensor's bytes (what KVChunk.checksums hold).

    XXH3 rather than crc32: about 20 GB/s against zlib.crc32's 4 on the CPUs we
    measured, so verifying every KV frame costs little of the transfer, and 64
    bits miss a corruption far less often than 32."""
    if isinstance(buffer, torch.Tensor):
        buffer = tensor_to_frame("", buffer)[1]
    return xxhash.xxh3_64_intdigest(_as_bytes_view(buffer))


def tensor_to_frame(name: str, tensor: torch.Tensor) -> tuple[dict, memoryview]:
    """(meta, frame) for one tensor; the frame is a view of the tensor, not a copy."""
    if not isinstance(tensor, torch.Tensor):
        raise ProtocolError(BAD_MESSAGE, f"tensor {name!r}: expected torch.Tensor, "
                            f"got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ProtocolError(BAD_MESSAGE, f"tensor {name!r} is on {tensor.device}; copy it to "
                            "the CPU before encoding")
    if tensor.dtype not in _DTYPE_NAMES:
        raise ProtocolError(BAD_MESSAGE, f"tensor {name!r}: dtype {tensor.dtype} is not one "
                            f"of {list(DTYPES)}")
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)  # bf16 has no numpy
    meta = {"name": name, "dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
            "nbytes": flat.numel()}
    return meta, memoryview(flat.numpy())  # the view keeps the tensor alive


def frame_to_tensor(meta: Any, frame: FrameLike, index: int = 0) -> torch.Tensor:
    """Rebuild a tensor over the frame's memory after checking it against its meta."""
    where = f"tensor {index}"
    if not isinstance(meta, dict):
        raise ProtocolError(BAD_MESSAGE, f"{where}: meta is a {type(meta).__name__}, "
                            "expected a map")
    name, dtype, shape, nbytes = (meta.get(k) for k in ("name", "dtype", "shape", "nbytes"))
    if not isinstance(name, str):
        raise ProtocolError(BAD_MESSAGE, f"{where}: meta.name must be a str")
    where = f"tensor {name!r}"
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ProtocolError(BAD_MESSAGE, f"{where}: dtype {dtype!r} is not one of {list(DTYPES)}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise ProtocolError(BAD_MESSAGE, f"{where}: shape {shape!r} is not a list of "
                            "non-negative ints")
    if not _is_int(nbytes) or nbytes < 0:
        raise ProtocolError(BAD_MESSAGE, f"{where}: nbytes {nbytes!r} is not a non-negative int")
    torch_dtype = DTYPES[dtype]
    want = math.prod(shape) * torch_dtype.itemsize
    if want != nbytes:
        raise ProtocolError(BAD_MESSAGE, f"{where}: shape {shape} x {dtype} is {want} bytes "
                            f"but the header says nbytes={nbytes}")
    view = _as_bytes_view(frame)
    if view.nbytes != nbytes:
        raise ProtocolError(BAD_MESSAGE, f"{where}: frame has {view.nbytes} bytes, header "
                            f"says nbytes={nbytes}")
    if nbytes == 0:
        return torch.empty(shape, dtype=torch_dtype)
    if view.readonly:  # e.g. bytes; zmq frames are writable. Torch warns, we know.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(view, dtype=torch.uint8)
    else:
        raw = torch.frombuffer(view, dtype=torch.uint8)
    if raw.data_ptr() % torch_dtype.itemsize:
        # Small frames can sit unaligned inside ZeroMQ's receive batch; copying
        # them is cheap. Large frames get their own (aligned) allocation.
        raw = raw.clone()
    return raw.view(torch_dtype).view(shape)


# ---------------------------------------------------------------- field types

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_SCALARS = {
    int: _is_int,
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    bool: lambda v: isinstance(v, bool),
    str: lambda v: isinstance(v, str),
    bytes: lambda v: isinstance(v, (bytes, bytearray)),
    dict: lambda v: isinstance(v, dict),
}


_EXACT = {int: {int}, str: {str}, bool: {bool}, bytes: {bytes}}


def _type_name(tp: Any) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is Union:
        return " or ".join("None" if a is type(None) else _type_name(a) for a in args)
    if typing.get_origin(tp) is list:
        return f"list[{_type_name(args[0])}]"
    return getattr(tp, "__name__", str(tp))


def _fail(path: str, tp: Any, value: Any) -> typing.NoReturn:
    raise ProtocolError(BAD_MESSAGE, f"{path}: expected {_type_name(tp)}, "
                        f"got {type(value).__name__}")


_FIELDS: dict[type, tuple] = {}


def _fields_of(cls: type) -> tuple:
    """(name, type, has_default) of a wire dataclass's fields, tensors excluded."""
    if cls not in _FIELDS:
        hints = typing.get_type_hints(cls)
        _FIELDS[cls] = tuple(
            (f.name, hints[f.name], f.default is not dataclasses.MISSING
             or f.default_factory is not dataclasses.MISSING)
            for f in dataclasses.fields(cls) if f.name != "tensors")
    return _FIELDS[cls]


def _convert(value: Any, tp: Any, path: str, out: bool) -> Any:
    """Check value against tp; out=True: dataclass -> map, out=False: map -> dataclass."""
    origin = typing.get_origin(tp)
    if origin is Union:
        if value is None:
            if type(None) in typing.get_args(tp):
                return None
            _fail(path, tp, value)
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _convert(value, inner, path, out)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            _fail(path, tp, value)
        (item,) = typing.get_args(tp)
        if item in _EXACT and set(map(type, value)) <= _EXACT[item]:
            return list(value)  # fast path (C speed) for token id lists
        return [_convert(v, item, f"{path}[{i}]", out) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if out:
            if not isinstance(value, tp):
                _fail(path, tp, value)
            return {name: _convert(getattr(value, name), hint, f"{path}.{name}", True)
                    for name, hint, _ in _fields_of(tp)}
        if not isinstance(value, dict):
            _fail(path, tp, value)
        kwargs = {}
        for name, hint, has_default in _fields_of(tp):
            if name in value:
                kwargs[name] = _convert(value[name], hint, f"{path}.{name}", False)
            elif not has_default:
                raise ProtocolError(BAD_MESSAGE, f"{path}.{name}: missing field "
                                    f"(expected {_type_name(hint)})")
        return tp(**kwargs)
    check = _SCALARS.get(tp)
    if check is None:
        raise TypeError(f"protocol: unsupported field type {tp!r} at {path}")
    if not check(value):
        _fail(path, tp, value)
    return float(value) if tp is float else value


# ---------------------------------------------------------------- codec

def encode(msg: Message) -> list[Union[bytes, memoryview]]:
    """``[header, *tensor_frames]``; tensor frames are views (keep the tensors unchanged
    until ZeroMQ is done with them)."""
    cls = type(msg)
    if MESSAGE_TYPES.get(getattr(cls, "TAG", None)) is not cls:
        raise ProtocolError(BAD_MESSAGE, f"{cls.__name__} is not a registered message type")
    header = {"v": PROTOCOL_VERSION, "t": cls.TAG}
    header.update(_convert(msg, cls, cls.__name__, out=True))
    msg._validate()
    metas, frames = [], []
    for name, tensor in getattr(msg, "tensors", {}).items():
        meta, frame = tensor_to_frame(name, tensor)
        metas.append(meta)
        frames.append(frame)
    header["tensors"] = metas
    try:
        packed = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:  # e.g. an int over 64 bits
        raise ProtocolError(BAD_MESSAGE, f"{cls.__name__}: cannot pack header ({e})") from None
    if len(packed) > MAX_HEADER_BYTES:
        raise ProtocolError(TOO_LARGE, f"{cls.__name__} header is {len(packed)} bytes, over "
                            f"MAX_HEADER_BYTES={MAX_HEADER_BYTES}; send fewer items per message")
    return [packed, *frames]


def unpack_bounded(data) -> Any:
    """msgpack.unpackb with a bound on how far the result may outgrow ``data``: at most one
    map or array per BYTES_PER_CONTAINER bytes (ProtocolError TOO_LARGE past it); strings,
    bins and arrays cannot be longer than the input either (msgpack's own limits)."""
    budget = [max(MIN_CONTAINERS, len(data) // BYTES_PER_CONTAINER)]

    def count(obj):
        budget[0] -= 1
        if budget[0] < 0:
            raise ProtocolError(TOO_LARGE, f"a {len(data)}-byte MessagePack value holds more "
                                f"than one map or array per {BYTES_PER_CONTAINER} bytes")
        return obj

    return msgpack.unpackb(data, raw=False, list_hook=count, object_hook=count)


def decode(frames: Sequence[FrameLike], expected: Optional[tuple[type, ...]] = None) -> Message:
    """Rebuild a message from its frames (tensors zero-copy over the frame buffers).

    Raises ProtocolError, and only ProtocolError, for anything not in the contract
    or, when ``expected`` is given, for a type this socket does not take.
    """
    try:
        return _decode(frames, expected)
    except ProtocolError:
        raise
    except Exception as e:  # a hostile peer must not find another exception type
        raise ProtocolError(BAD_MESSAGE, f"malformed message ({type(e).__name__}: "
                            f"{str(e)[:200]})") from e


def _decode(frames: Sequence[FrameLike], expected: Optional[tuple[type, ...]]) -> Message:
    if len(frames) == 0:
        raise ProtocolError(BAD_MESSAGE, "empty message: no header frame")
    head = _as_bytes_view(frames[0])
    if head.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(TOO_LARGE, f"header is {head.nbytes} bytes, over "
                            f"MAX_HEADER_BYTES={MAX_HEADER_BYTES}")
    try:
        header = unpack_bounded(head)
    except ProtocolError:
        raise
    except Exception as e:
        raise ProtocolError(BAD_MESSAGE, f"header is not valid MessagePack ({type(e).__name__}: "
                            f"{str(e)[:200]})") from None
    if not isinstance(header, dict):
        raise ProtocolError(BAD_MESSAGE, f"header is a {type(header).__name__}, expected a map")
    version = header.get("v")
    if not _is_int(version):
        raise ProtocolError(BAD_MESSAGE, f"header has no protocol version 'v' (got {version!r})")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(VERSION_MISMATCH, f"peer speaks protocol version {version}, this "
                            f"process speaks version {PROTOCOL_VERSION}; upgrade one side")
    tag = header.get("t")
    cls = MESSAGE_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ProtocolError(UNKNOWN_TYPE, f"unknown message type {tag!r}; known types: "
                            f"{', '.join(MESSAGE_TYPES)}")
    if expected is not None and cls not in expected:
        raise ProtocolError(UNEXPECTED_TYPE, f"unexpected message type {cls.__name__} on this "
                            f"socket, expected one of {', '.join(c.__name__ for c in expected)}")
    metas = header.get("tensors")
    if not isinstance(metas, list):
        raise ProtocolError(BAD_MESSAGE, f"{cls.__name__}: header 'tensors' must be a list, "
                            f"got {type(metas).__name__}")
    takes_tensors = any(f.name == "tensors" for f in dataclasses.fields(cls))
    if metas and not takes_tensors:
        raise ProtocolError(BAD_MESSAGE, f"{cls.__name__} carries no tensors but the header "
                            f"declares {len(metas)}")
    if len(frames) - 1 != len(metas):
        raise ProtocolError(BAD_MESSAGE, f"{cls.__name__} header declares {len(metas)} tensor "
                            f"frame(s) but {len(frames) - 1} followed")
    msg = _convert(header, cls, cls.__name__, out=False)
    if takes_tensors:
        tensors = {}
        for i, (meta, frame) in enumerate(zip(metas, frames[1:])):
            tensor = frame_to_tensor(meta, frame, i)
            if meta["name"] in tensors:
                raise ProtocolError(BAD_MESSAGE, f"{cls.__name__}: tensor {meta['name']!r} "
                                    "appears twice")
            tensors[meta["name"]] = tensor
        msg = dataclasses.replace(msg, tensors=tensors)
    msg._validate()
    return msg
