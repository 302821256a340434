"""A node's side of the routers' prefix indexes (router/kv_index.py): its KV-event
publisher, on by default wherever prefix caching is on (a router with ``--policy
cache_aware`` builds its index from these events, so a node must not need a flag for
it), and its answer to a router's IndexDumpRequest.

Without ``--kv-events-config`` the publisher binds a free port on 127.0.0.1: the same
machine's routers reach it, nothing else does. Routers on other machines need the
node to bind an open endpoint (``{"enable_kv_cache_events": true, "endpoint":
"tcp://*:5560"}``): an open socket is the user's choice, as the KV socket's is.
"""
from __future__ import annotations

import logging

import msgspec

from pdserve.common import discovery as D
from pdserve.common import protocol as P
from pdserve.common.kv_events import KVEventPublisher, KVEventsConfig
from pdserve.common.limits import MAX_INDEX_BLOCKS

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "tcp://127.0.0.1:*"


def make_publisher(config, engine, block_size: int) -> KVEventPublisher | None:
    """The node's publisher (not yet bound), or None when it publishes nothing."""
    events = config.kv_events
    if events is None:
        if not config.engine.enable_prefix_caching:
            return None
        events = KVEventsConfig(enable_kv_cache_events=True, endpoint=DEFAULT_ENDPOINT)
    if not events.active:
        return None
    if not config.engine.enable_prefix_caching:
        log.warning("KV-cache events need prefix caching, which is off: none will be "
                    "published")
        return None
    engine.allocator.record_events()
    medium = "GPU" if str(config.engine.device).startswith("cuda") else "CPU"
    return KVEventPublisher(events, block_size, medium)


def start_publisher(node) -> None:
    """Binds the publisher and puts its address in the Hello; before the I/O thread
    starts, which says that Hello."""
    events = node.kv_events
    if events is None:
        return
    events.start_and_wait()
    address = D.advertised(events.endpoint, node.config.advertise_host)
    node.io.hello = msgspec.structs.replace(node.io.hello, kv_events=address)
    log.info("KV-cache events on %s (announced as %s)%s", events.endpoint, address,
             f", replay on {events.replay_endpoint}" if events.replay_endpoint else "")


def answer_dump(node, router: str, msg: P.IndexDumpRequest) -> None:
    """Every block key of the node's prefix cache, to the router that asked, as of the
    last batch of events published. On the compute loop, which owns the allocator: what
    its events say and what the dump says cannot cross."""
    events, allocator = node.kv_events, node.engine.allocator
    seq = -1
    if events is not None:
        events.publish(allocator.drain_events())  # numbered before the dump: in it
        seq = events.last_seq
    hashes = allocator.cached_hashes()
    truncated = len(hashes) > MAX_INDEX_BLOCKS
    if truncated:  # the most recently stored ones: the likeliest to be asked for
        hashes = hashes[-MAX_INDEX_BLOCKS:]
    log.info("index dump for router %s (%s): %d block keys as of event batch %d", router,
             msg.reason or "no reason given", len(hashes), seq)
    node.io.send_control(P.IndexDump(seq=seq, block_hashes=hashes, truncated=truncated),
                         to=router)
