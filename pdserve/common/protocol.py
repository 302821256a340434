"""The wire contract between router, prefill nodes and decode nodes.

Every process must agree on exactly what travels, so every message type, its
tag and the protocol version live here and nowhere else; the only logic is
validation; codec.py turns messages into frames and back. docs/protocol.md is the
prose version.

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
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch

from pdserve.common.config import ROLES
from pdserve.common.errors import BAD_MESSAGE

PROTOCOL_VERSION = 3  # what each version added: docs/protocol.md, "Versioning"
MAX_HEADER_BYTES = 16 * 1024 * 1024  # a header is metadata; KV travels in frames
MAX_SEED = 2**63        # seeds are in [0, 2^63): a signed 64-bit value on every side
MAX_WIRE_INT = 2**63    # the most any count or id on the wire may be (msgpack packs up to 2^64)
MAX_HOST_ID = 256       # Hello.host_id: boot id + /dev/shm identity


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
