"""KV-plane messages (prefill node -> decode node KV socket, and its acknowledgements)."""
from typing import Any, Literal, Optional

from pdserve.common.errors import BAD_MESSAGE
from pdserve.common.protocol.base import (
    DTYPES,
    MAX_KV_PARTS,
    MAX_TENSOR_DIMS,
    MAX_WIRE_INT,
    Count,
    Id,
    Int64,
    Message,
    Nested,
    ProtocolError,
    Text,
    UInt64,
    _message,
    list_of,
)
from pdserve.common.protocol.messages import KVLayout, ModelIdentity


def dtype_name(tensor) -> str:
    """A tensor's wire dtype name ("torch.bfloat16" -> "bfloat16"), read without importing
    torch: the schema imports no torch (the queue clients and the router import it)."""
    return str(tensor.dtype).removeprefix("torch.")


class TensorMeta(Nested, kw_only=True):
    """How one tensor travels: its raw bytes are frame ``frame`` after the header (1 is
    the first frame after it), C-contiguous, ``dtype`` x ``shape`` bytes long."""
    dtype: Literal[DTYPES]
    shape: list_of(Count, MAX_TENSOR_DIMS)
    frame: Count


class ShmKV(Nested, kw_only=True):
    """Where a KVChunk's pages lie in the sender's shared-memory segment (same host)."""
    segment: Id              # file name under /dev/shm
    offsets: list_of(Count)  # byte offset of each tensor's page pool, in tensor-name order
    block_ids: list_of(Count)  # the sender's pages of the parts, in the parts' order


class KVPart(Nested, kw_only=True):
    """One request's share of a KVChunk: num_blocks(block_size) pages in every tensor, after
    the pages of the parts before it. The leading first_block blocks of its prompt are the
    decode node's cached ones and do not travel."""
    req_id: Id
    num_tokens: Count
    first_block: Count = 0
    first_token: Optional[Int64] = None  # set on the last chunk

    def num_blocks(self, block_size: int) -> int:
        return -(-self.num_tokens // block_size) - self.first_block


@_message
class KVChunk(Message, tag="kv_chunk", kw_only=True):
    """prefill -> decode (KV socket): KV of layers [layer_start, layer_end) of the requests
    of one prefill step bound for this decode node, one part each (at most MAX_KV_PARTS).

    Tensors "k{layer}" / "v{layer}", each [total_blocks, block_size, num_kv_heads,
    head_dim] in kv_layout.dtype: the parts' pages one after the other. ``checksums`` (or
    none) holds one XXH3 per tensor, in tensor-name order, over those pages in that order
    (with shm: over the pages shm.block_ids names in that tensor's pool): one hash per
    frame, so a corrupt frame fails every request of the chunk.
    """
    model: ModelIdentity
    kv_layout: KVLayout
    layer_start: Count
    layer_end: Count
    last: bool
    parts: list_of(KVPart, MAX_KV_PARTS)
    shm: Optional[ShmKV] = None  # same host: the pages are there, not in tensor frames
    checksums: list_of(UInt64) = []  # XXH3 of each tensor's pages; empty: not checked
    # In memory {name: torch.Tensor}; on the wire {name: TensorMeta}, the bytes in frames
    # (codec.encode swaps one for the other). Equality ignores them, as tensors have none.
    tensors: dict[Id, TensorMeta] = {}

    def __eq__(self, other: Any) -> bool:
        if type(other) is not KVChunk:
            return NotImplemented
        names = [n for n in self.__struct_fields__ if n != "tensors"]
        return all(getattr(self, n) == getattr(other, n) for n in names)

    def __repr__(self) -> str:
        return (f"KVChunk(parts={self.parts!r}, layers=[{self.layer_start}, "
                f"{self.layer_end}), last={self.last}, tensors={list(self.tensors)})")

    def _validate(self) -> None:
        lay = self.kv_layout
        where = f"KVChunk {self.parts[0].req_id!r}.." if self.parts else "KVChunk"
        if lay.dtype not in DTYPES:
            raise ProtocolError(BAD_MESSAGE, f"{where}: kv_layout.dtype {lay.dtype!r} is not one "
                                f"of {list(DTYPES)}")
        if not 0 <= self.layer_start < self.layer_end <= lay.num_layers:
            raise ProtocolError(BAD_MESSAGE, f"{where}: layers [{self.layer_start}, "
                                f"{self.layer_end}) not inside [0, {lay.num_layers})")
        if not 1 <= len(self.parts) <= MAX_KV_PARTS:
            raise ProtocolError(BAD_MESSAGE, f"{where}: {len(self.parts)} parts, expected 1 to "
                                f"{MAX_KV_PARTS}")
        if len({p.req_id for p in self.parts}) != len(self.parts):
            raise ProtocolError(BAD_MESSAGE, f"{where}: a request id appears in two parts")
        names = kv_tensor_names(self.layer_start, self.layer_end)
        for part in self.parts:
            _validate_part(part, lay.block_size, self.last)
        if self.checksums and len(self.checksums) != len(names):
            raise ProtocolError(BAD_MESSAGE, f"{where}: {len(self.checksums)} checksums for "
                                f"{len(names)} tensors (one per tensor, or none)")
        total = sum(p.num_blocks(lay.block_size) for p in self.parts)
        if self.shm is not None:
            self._validate_shm(where, len(names), total)
        elif sorted(self.tensors) != sorted(names):
            raise ProtocolError(BAD_MESSAGE, f"{where}: tensors {list(self.tensors)}, "
                                f"expected {names}")
        shape = (total, lay.block_size, lay.num_kv_heads, lay.head_dim)
        for name, t in self.tensors.items():
            if tuple(t.shape) != shape or dtype_name(t) != lay.dtype:
                raise ProtocolError(BAD_MESSAGE, f"{where}: tensor {name!r} is {list(t.shape)} "
                                    f"{t.dtype}, expected {list(shape)} {lay.dtype}")

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


def _validate_part(part: KVPart, block_size: int, last: bool) -> None:
    where = f"KVChunk part {part.req_id!r}"
    if part.num_tokens <= 0 or block_size <= 0:
        raise ProtocolError(BAD_MESSAGE, f"{where}: num_tokens={part.num_tokens} and "
                            f"block_size={block_size} must be positive")
    if not 0 <= part.first_block < -(-part.num_tokens // block_size):
        raise ProtocolError(BAD_MESSAGE, f"{where}: first_block={part.first_block} leaves "
                            "no block of the prompt to send")
    if part.first_token is not None and not last:
        raise ProtocolError(BAD_MESSAGE, f"{where}: first_token set on a chunk that is "
                            "not last")


def kv_tensor_names(layer_start: int, layer_end: int) -> list[str]:
    """A KVChunk's tensors, in wire order: k{l}, v{l} for each layer l."""
    return [f"{kv}{i}" for i in range(layer_start, layer_end) for kv in "kv"]


class KVResult(Nested, kw_only=True):
    """Whether one request's KV arrived whole (ok), or why not."""
    req_id: Id
    ok: bool
    reason: Text = ""


@_message
class KVAck(Message, tag="kv_ack", kw_only=True):
    """decode -> prefill (KV socket): the outcome of each request of a KVChunk that is
    settled (placed whole with the last chunk, or refused)."""
    results: list_of(KVResult)
