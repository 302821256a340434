"""The KV transfer interface: one state for both sides, the sending half of a backend
(``KVSender``) and the receiving half (``PageSource``, read by ``KVReceiver``).

See the package docstring for the way a request's KV goes and where a backend plugs in.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable

import torch

from pdserve.common import protocol as P
from pdserve.engine.host_memory import SparseStorage
from pdserve.node.kv.pages import KVCaches, page_bytes, pool_bytes

# How a KV message reaches a decode node's KV address (NodeIO.send_kv, or a FakeLink).
Post = Callable[[str, P.KVChunk], None]


class TransferState(enum.Enum):
    """One request's KV transfer, on either side; nothing is left half-done in silence::

        prefill: BOOTSTRAPPING (admitted, prefilling; the decode node has reserved)
                   --every chunk sent, the blocks held--> TRANSFERRING
                   --KVAck ok--> SUCCESS (blocks freed)
                   refused / unsent / no KVAck before the deadline --> FAILED
        decode:  BOOTSTRAPPING (blocks reserved, lease running)
                   --a chunk placed--> TRANSFERRING --every layer placed--> SUCCESS
                   mismatch / bad checksum / lease expiry --> FAILED
    """
    BOOTSTRAPPING = "bootstrapping"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"


class KVTransferError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Outgoing:
    """One request's pages for a sender."""
    req_id: str
    block_ids: list[int]      # its blocks that travel: those after the decode node's cached
    num_tokens: int
    first_block: int = 0      # leading blocks of the prompt the decode node has cached
    first_token: int | None = None  # on the last chunk


@dataclass
class InboundTransfer:
    """The decode node's side of one request's transfer: where its KV goes."""
    req_id: str
    block_ids: torch.Tensor      # the blocks the KV goes to: those after the cached ones
    num_tokens: int
    first_block: int = 0         # leading blocks of the prompt already cached here
    state: TransferState = TransferState.BOOTSTRAPPING
    layers_done: set[int] = field(default_factory=set)


class KVSender:
    """One way KV leaves a prefill node: a backend's sending half. A prefill node holds a
    list of them, most preferred first, and sends each decode node's KV by the first that
    ``reaches`` it. Made before the engine (``storage`` may decide where the KV cache
    lives), ``attach``-ed once it exists."""
    path = ""  # the name of the way: the metric's path label, the log's words

    def __init__(self, post: Post, checksums: bool = True):
        self.post = post
        self.checksums = checksums
        self.host_id = ""
        self.model: P.ModelIdentity | None = None
        self.layout: P.KVLayout | None = None
        self.kv_caches: KVCaches = []
        self.views: list = []

    def storage(self, nbytes: int) -> torch.Tensor | SparseStorage | None:
        """Where the CPU KV cache must live for this way to read it (a uint8 tensor of
        nbytes, or a SparseStorage backed as blocks are first used); None: anywhere.
        Asked once, before the engine allocates the cache."""
        return None

    def attach(self, model: P.ModelIdentity, layout: P.KVLayout, kv_caches: KVCaches,
               host_id: str = "") -> None:
        self.model, self.layout, self.kv_caches = model, layout, kv_caches
        self.views = pool_bytes(kv_caches)  # once: a view per message costs as much as a hash
        self.host_id = host_id

    def reaches(self, req: P.PrefillRequest) -> bool:
        """Whether this way can carry the KV to the request's decode node."""
        return True

    def describe(self, req: P.PrefillRequest) -> str:
        """How the KV goes to the request's decode node, in words for the log."""
        return f"by {self.path}"

    def chunk(self, parts: list[Outgoing], start: int, end: int, last: bool) -> P.KVChunk:
        """The one message carrying layers [start, end) of ``parts``' pages."""
        raise NotImplementedError

    def send(self, address: str, parts: list[Outgoing], start: int, end: int,
             last: bool) -> int:
        """Sends layers [start, end) of ``parts`` to the decode node at ``address``;
        returns the KV bytes moved."""
        chunk = self.chunk(parts, start, end, last)
        self.post(address, chunk)
        return payload_bytes(chunk)

    def close(self) -> None:
        """Frees what the way holds outside the process."""


class PageSource:
    """Where a decode node reads an arriving chunk's pages: a backend's receiving half.
    The chunk says which source it is for (tensor frames, a shared segment, ...)."""

    def carries(self, chunk: P.KVChunk) -> bool:
        raise NotImplementedError

    def pages(self, chunk: P.KVChunk, names: list[str], page_nbytes: int
              ) -> tuple[list[memoryview], list[int]]:
        """Each tensor's pages as bytes (in ``names`` order), and the page index in them
        of each of the chunk's blocks (the parts' blocks one after the other). Raises
        KVTransferError when they cannot be read."""
        raise NotImplementedError

    def tick(self, now: float) -> None:
        """Called every turn of the node's loop (cleanup on a clock)."""

    def close(self) -> None:
        """Frees what the source holds (mappings of peers' memory)."""


def make_chunk(model: P.ModelIdentity, layout: P.KVLayout, parts: list[Outgoing],
               start: int, end: int, last: bool, **payload) -> P.KVChunk:
    """A KVChunk of ``parts`` whose pages travel as ``payload`` says (tensors, shm, ...)."""
    wire_parts = [P.KVPart(req_id=p.req_id, num_tokens=p.num_tokens, first_block=p.first_block,
                           first_token=p.first_token) for p in parts]
    return P.KVChunk(model=model, kv_layout=layout, layer_start=start, layer_end=end,
                     last=last, parts=wire_parts, **payload)


def payload_bytes(chunk: P.KVChunk) -> int:
    """The KV bytes a chunk moves, in frames or through shared memory."""
    if chunk.shm is None:
        return sum(t.nbytes for t in chunk.tensors.values())
    return len(chunk.shm.offsets) * len(chunk.shm.block_ids) * page_bytes(chunk.kv_layout)
