"""The protocol's foundations: version and limits, the wire dtypes, the field types that
carry the limits, the message base classes and registry, and the one error every decoder
raises (with the Error message that answers it).

Every wire type is a ``msgspec.Struct``: msgspec decodes and checks a header in C against
the declared types and ``Meta`` limits, which is what made the hand-written validator the
slowest part of a message's way. Top-level messages are tagged arrays (``[tag, field...]``:
no key strings on the wire); a union of array-like and map-like structs cannot be decoded
in one pass, so every message is array-like, and only a few cold nested types (KVLayout,
ModelIdentity) stay maps. The limits and the field types that carry them are
common/limits.py's (shared with the sampling type and the queue schema).
"""
from typing import Any, ClassVar, Optional

import msgspec

from pdserve.common.config import DTYPE_BYTES
from pdserve.common.limits import (  # noqa: F401 (the limits and field types of the wire)
    MAX_ID_CHARS,
    MAX_ITEMS,
    MAX_LOGPROBS,
    MAX_SEED,
    MAX_TEXT_CHARS,
    MAX_WIRE_INT,
    Count,
    Id,
    Int64,
    Seed,
    Text,
    TokenIds,
    UInt64,
    list_of,
)

PROTOCOL_VERSION = 10  # what each version added: docs/protocol.md, "Versioning"
MAX_HEADER_BYTES = 16 * 1024 * 1024  # a header is metadata; KV travels in frames
MAX_HOST_ID = 256       # Hello.host_id: boot id + /dev/shm identity
MAX_KV_PARTS = 4096     # requests in one KVChunk
MAX_TENSOR_DIMS = 8

# Wire dtype names (also used by KVLayout.dtype); codec.TORCH_DTYPES maps them to torch's.
DTYPES = tuple(DTYPE_BYTES)

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
        return Error(req_id=req_id, code=self.code, message=self.message[:MAX_TEXT_CHARS])


class Nested(msgspec.Struct, kw_only=True, frozen=True, array_like=True, gc=False):
    """A type carried inside messages, encoded as an array of its fields in declared
    order. Fields are only ever appended (with defaults): an old decoder ignores trailing
    entries it does not know, a new one fills in defaults for entries an old peer omits.
    gc=False: wire structs hold no cycles, and skipping the GC makes decoding cheaper."""


class NestedMap(msgspec.Struct, kw_only=True, frozen=True, gc=False, forbid_unknown_fields=False):
    """A cold nested type kept as a map (readable in a dump, sent once per node or chunk)."""


class Message(msgspec.Struct, kw_only=True, frozen=True, array_like=True, gc=False,
              tag_field="t"):
    """Base of every top-level wire message: ``[TAG, field, ...]`` on the wire."""

    TAG: ClassVar[str] = ""

    def _validate(self) -> None:
        """Cross-field checks beyond field types; run on encode and on decode."""


MESSAGE_TYPES: dict[str, type] = {}


def _message(cls):
    """Registers a Message subclass (declared with ``tag=...``) under its tag."""
    tag = cls.__struct_config__.tag
    assert isinstance(tag, str) and tag not in MESSAGE_TYPES, (cls, tag)
    cls.TAG = tag
    MESSAGE_TYPES[tag] = cls
    return cls


@_message
class Error(Message, tag="error", kw_only=True):
    """any direction: something failed; code is one of ERROR_CODES."""
    req_id: Optional[Id] = None
    code: Id
    message: Text
