"""The protocol's foundations: version and limits, the wire dtypes, the message base
class and registry, and the one error every decoder raises (with the Error message that
answers it)."""
import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

PROTOCOL_VERSION = 4  # what each version added: docs/protocol.md, "Versioning"
MAX_HEADER_BYTES = 16 * 1024 * 1024  # a header is metadata; KV travels in frames
MAX_SEED = 2**63        # seeds are in [0, 2^63): a signed 64-bit value on every side
MAX_WIRE_INT = 2**63    # the most any count or id on the wire may be (msgpack packs up to 2^64)
MAX_HOST_ID = 256       # Hello.host_id: boot id + /dev/shm identity
MAX_KV_PARTS = 4096     # requests in one KVChunk


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


@_message("error")
class Error(Message):
    """any direction: something failed; code is one of ERROR_CODES."""
    req_id: Optional[str] = None
    code: str
    message: str
