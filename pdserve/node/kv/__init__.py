"""KV transfer between nodes behind one small interface, as SGLang's disaggregation
keeps it (``BaseKVSender`` / ``BaseKVReceiver``, one folder per backend).

A request's KV, prefill node to decode node::

    router: Reserve on the decode node       --> decode: blocks reserved, InboundTransfer
                                                 BOOTSTRAPPING, lease running
    router: PrefillBatch to the prefill node --> prefill: job BOOTSTRAPPING
    prefill step, each layer group final     --> KVSender.send: one KVChunk per decode node
                                                 for all the step's requests bound for it
    last chunk (with the first tokens) sent  --> prefill: TRANSFERRING, blocks held
    decode: KVReceiver.place per chunk       --> TRANSFERRING ... every layer: SUCCESS, the
                                                 sequence joins the engine; KVAck per chunk
    prefill: KVAck                           --> SUCCESS or FAILED; blocks freed
    any check, checksum, lease or deadline   --> FAILED on that side, the router told why

Pieces (``TransferState`` is the one state of both sides):

- ``base.py``: ``TransferState``, ``KVTransferError``, ``Outgoing`` / ``InboundTransfer``
  (one request's pages on each side), ``KVSender`` (a way KV leaves a prefill node) and
  ``PageSource`` (where a decode node reads an arriving chunk's pages).
- ``receiver.py``: ``KVReceiver``, the one receiving half: checks every part against the
  node's model, layout and reservation, reads the pages from the source the chunk names,
  places them with checksums, answers by ``reply``.
- backends, one module each: ``tcp.py`` (tensor frames of the message over the KV
  socket), ``shm.py`` (same host: the message names pages of the sender's /dev/shm
  segment, ``segment.py``), ``fake.py`` (an in-process link for node tests).
- ``pages.py``: the memory work they share (runs, copies, checksums).

A prefill node sends each decode node's KV by the first of its senders that
``reaches`` it (shm, then tcp); a decode node reads every kind that arrives.

A GPU-direct backend (NIXL, RDMA, NCCL) plugs in as ``gpu.py`` here:

1. a ``KVSender`` subclass: ``storage`` registers the device KV pool with the
   transport, ``reaches`` says which decode nodes it can write to, ``chunk`` makes
   the KVChunk that names the pages moved (a descriptor field beside ``shm`` in
   common/protocol/kv.py: a wire change, so the protocol version goes up);
2. a ``PageSource`` subclass, added to ``receiver.default_sources``: ``carries``
   recognises that field, ``pages`` returns the pages (read remotely, or written
   into a staging buffer by the peer), so the checks, checksums, placing and
   state above stay as they are. A backend that writes straight into the reserved
   blocks (one-sided writes) would also have ``place`` skip the copy for its chunks
   and only check them: the one change it makes outside its own module.
"""
from pdserve.node.kv.base import (  # noqa: F401 (this package's API)
    InboundTransfer,
    KVSender,
    KVTransferError,
    Outgoing,
    PageSource,
    TransferState,
    payload_bytes,
)
from pdserve.node.kv.receiver import KVReceiver, default_sources  # noqa: F401
from pdserve.node.kv.shm import ShmSender  # noqa: F401
from pdserve.node.kv.tcp import TcpSender  # noqa: F401


def default_senders(post, *, shm: bool, checksums: bool) -> list[KVSender]:
    """A prefill node's ways, most preferred first: /dev/shm (when on) for same-host
    decode nodes, then TCP for every other."""
    return ([ShmSender(post, checksums)] if shm else []) + [TcpSender(post, checksums)]
