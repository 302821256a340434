"""What feeds a cache_aware router's prefix index (dispatch/prefix_index.py): a SUB socket
on each node's KV events, and the node's index dumps.

A SUB is connected when a node registers (its Hello says where it publishes) and closed
when it is removed. One task on the router's event loop polls every SUB without waiting
(plain sockets: a poll of all of them costs microseconds) and sleeps IDLE_S when none has
anything: at most ``BATCHES_PER_TURN`` batches from one socket, then the loop is given
back, so the events of a busy cluster never hold up the router's clock or its requests.
The same task asks for the dumps the index wants (an IndexDumpRequest on the control
socket; the IndexDump comes back through control.py) and keeps the metric of which
nodes' indexes are degraded.
"""
from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import zmq

from pdserve.common import protocol as P
from pdserve.common.kv_events import decode_batch
from pdserve.common.logs import LogThrottle
from pdserve.common.sockets import make_socket
from pdserve.router.dispatch.flight import Output
from pdserve.router.dispatch.prefix_index import PrefixIndex
from pdserve.router.dispatch.registry import (
    REGISTERED,
    REMOVED,
    NodeInfo,
    Registry,
    kv_address_problem,
)

log = logging.getLogger(__name__)

BATCHES_PER_TURN = 256         # from one node's socket before the loop is given back
SUB_RCVHWM = 100_000           # batches queued per node (the node's PUB keeps as many)
MAX_EVENT_BATCH_BYTES = 16 << 20
IDLE_S = 0.02                  # the task's sleep when no socket has events
ASK_EVERY_S = 0.1              # dumps due are asked, and the metric set, this often


class KVIndexFeed:
    def __init__(self, index: PrefixIndex, registry: Registry, control, metrics):
        self.index, self.registry, self.control, self.metrics = index, registry, control, metrics
        self._ctx = zmq.Context()
        self._subs: dict[str, zmq.Socket] = {}
        self._bad_log = LogThrottle(period_s=10.0)
        self._next_ask = 0.0
        registry.subscribe(self._membership)

    def _membership(self, event: str, node: NodeInfo) -> None:
        if event == REMOVED:
            self._close(node.node_id)
            self.metrics.prefix_index_node_gone(node.node_id)
        elif event == REGISTERED:
            self._close(node.node_id)   # a new process: its old stream is over
            address = node.hello.kv_events
            if address is None:
                log.warning("node %s publishes no KV events (prefix caching off, or "
                            "--kv-events-config turned them off): cache_aware cannot see "
                            "its cache", node.node_id)
                return
            problem = kv_address_problem(address)  # (a node's word: checked as its KV address)
            if problem is not None:
                log.warning("node %s's KV-event address is not used (%s); its index comes "
                            "from dumps only", node.node_id, problem.replace("kv_address", ""))
                return
            try:
                sub = make_socket(self._ctx, zmq.SUB, connect=address, rcvhwm=SUB_RCVHWM,
                                  max_msg_size=MAX_EVENT_BATCH_BYTES)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
            except zmq.ZMQError as exc:
                log.warning("cannot subscribe to node %s's KV events at %r: %s; its index "
                            "comes from dumps only", node.node_id, address, exc)
                return
            self._subs[node.node_id] = sub
            log.info("subscribed to node %s's KV events at %s", node.node_id, address)

    def _close(self, node_id: str) -> None:
        sub = self._subs.pop(node_id, None)
        if sub is not None:
            sub.close(linger=0)

    # -- from control.py -------------------------------------------------------------------
    def dump(self, node_id: str, msg: P.IndexDump) -> None:
        if self.index.dump(node_id, msg.seq, msg.block_hashes, time.monotonic()):
            log.info("prefix index of node %s: dump of %d blocks as of event batch %d%s",
                     node_id, len(msg.block_hashes), msg.seq,
                     " (truncated by the node)" if msg.truncated else "")
            # Now, not at the next _ask: the dump may be what makes /health ready, and a
            # scrape that follows a 200 must see the index it says is in.
            self._set_metric(node_id)
        elif self._bad_log(("unasked", node_id)) is not None:  # (or asked twice: a retry)
            log.info("an index dump from node %s that was not asked for: ignored", node_id)

    def heartbeat(self, node_id: str, stats: P.NodeStats) -> None:
        self.index.heartbeat(node_id, stats.kv_events_seq)

    # -- readiness ------------------------------------------------------------------------
    def readiness(self) -> tuple[bool, str]:
        pending = self.index.pending(time.monotonic())
        if pending:
            return False, (f"the prefix index waits for the index dumps of {len(pending)} "
                           f"node(s): {', '.join(pending[:20])}")
        degraded = [n for n in self.index.nodes if self.index.degraded(n)]
        return True, (f"prefix index degraded for {', '.join(degraded[:20])}" if degraded
                      else "")

    # -- the task -------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            try:
                self._ask(time.monotonic())
                busy = False
                poller = zmq.Poller()
                subs = list(self._subs.items())
                for _, sock in subs:
                    poller.register(sock, zmq.POLLIN)
                ready = dict(poller.poll(0)) if subs else {}
                for node_id, sock in subs:
                    if sock in ready and self._subs.get(node_id) is sock:
                        busy = True
                        self._read(node_id, sock)
                        await asyncio.sleep(0)   # one node's burst, then the loop's turn
                if not busy:
                    await asyncio.sleep(IDLE_S)
            except asyncio.CancelledError:
                raise
            except Exception:  # the index is advisory: count it, keep reading
                self.metrics.internal_error("router.kv_index", log)
                await asyncio.sleep(IDLE_S)

    def _read(self, node_id: str, sock) -> None:
        for _ in range(BATCHES_PER_TURN):
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            batch, seq = None, -1
            if len(frames) == 3 and len(frames[1]) == 8:
                seq = int.from_bytes(frames[1], "big")
                try:
                    batch = decode_batch(frames[2])
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    if self._bad_log(("bad", node_id)) is not None:
                        log.warning("KV event batch %d from node %s does not decode: %s",
                                    seq, node_id, exc)
            if seq < 0:
                if self._bad_log(("frames", node_id)) is not None:
                    log.warning("a KV event message of %d frames from node %s ignored",
                                len(frames), node_id)
                continue
            self.index.batch(node_id, seq, batch)

    def _ask(self, now: float) -> None:
        if now < self._next_ask:
            return
        self._next_ask = now + ASK_EVERY_S
        sends = []
        for node_id, reason in self.index.due(now):
            entry = self.index.nodes[node_id]
            log.info("asking node %s for its prefix index: %s", node_id, entry.why)
            sends.append((node_id, P.IndexDumpRequest(reason=entry.why[:200])))
            self.metrics.prefix_index_dump(reason)
        if sends:
            self.control.apply(Output(sends=sends))
        for node_id in self.index.nodes:
            self._set_metric(node_id)

    def _set_metric(self, node_id: str) -> None:
        self.metrics.prefix_index(node_id, self.index.degraded(node_id),
                                  self.index.num_blocks(node_id))

    def close(self) -> None:
        for sock in self._subs.values():
            sock.close(linger=0)
        self._subs.clear()
        self._ctx.term()
