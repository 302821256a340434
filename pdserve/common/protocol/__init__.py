"""The wire contract between router, prefill nodes and decode nodes.

Every process must agree on exactly what travels, so every message type, its
tag, its limits and the protocol version live in this package and nowhere else:
base.py (version, dtypes, the message registry, ProtocolError and Error; the limits
and the field types that carry them are common/limits.py's, the sampling type is
common/sampling.py's), messages.py (the control plane), kv.py (the KV plane),
index.py (the prefix-index dump), queue.py (the queue ingress, a public contract of its
own: maps, no version).
Every type is a ``msgspec.Struct``; the only logic is cross-field validation.
codec.py turns messages into frames and back. docs/protocol.md is the prose
version. Import it as one module: ``from pdserve.common import protocol as P``.
The package imports no torch (the queue clients import it); codec.py does.

Wire form: one multipart message ``[header, frame_1, ..., frame_n]``. The
header is the MessagePack array ``[version, [tag, field, ...]]``; a KVChunk's
``tensors`` field holds each tensor's dtype, shape and frame index, and each
tensor is its own raw frame, so a multi-GB KV transfer is neither copied into
msgpack nor pickled, and the receiver rebuilds tensors over the received frame
buffers without a copy. Times are relative durations in seconds (``*_s``):
clocks differ between machines.

Decoding never trusts the peer: anything malformed raises ``ProtocolError``
with a message naming the offending field, so the receiver can answer with an
``Error`` message and keep serving.
"""
from pdserve.common.protocol.base import (  # noqa: F401 (this package's API)
    DTYPES,
    MAX_HEADER_BYTES,
    MAX_HOST_ID,
    MAX_ID_CHARS,
    MAX_ITEMS,
    MAX_KV_PARTS,
    MAX_LOGPROBS,
    MAX_SEED,
    MAX_TENSOR_DIMS,
    MAX_TEXT_CHARS,
    MAX_WIRE_INT,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Error,
    FrameLike,
    Message,
    Nested,
    NestedMap,
    ProtocolError,
)
from pdserve.common.protocol.index import (  # noqa: F401 (this package's API)
    IndexDump,
    IndexDumpRequest,
)
from pdserve.common.protocol.kv import (  # noqa: F401 (this package's API)
    KVAck,
    KVChunk,
    KVPart,
    KVResult,
    ShmKV,
    TensorMeta,
    kv_tensor_names,
)
from pdserve.common.protocol.messages import (  # noqa: F401 (this package's API)
    Abort,
    Bye,
    Drain,
    FirstToken,
    FirstTokens,
    Heartbeat,
    Hello,
    KVLayout,
    Logprobs,
    ModelIdentity,
    NodeStats,
    PrefillBatch,
    PrefillRequest,
    Release,
    Reserve,
    ReserveReply,
    ReserveRequest,
    ReserveResult,
    Resume,
    Resumed,
    StreamOrigin,
    TokenBatch,
    TokenItem,
    Welcome,
    peer_identity,
)
from pdserve.common.sampling import SamplingParams  # noqa: F401 (PrefillRequest.sampling)
