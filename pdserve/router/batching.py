"""The prefill side of the router's dispatch: which prefill node an attempt goes to, and
how what one node gets in one loop turn leaves as PrefillBatch messages that fit the
protocol's header limit. ``PrefillDispatch`` is mixed into RouterCore."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from pdserve.common import protocol as P
from pdserve.router import streams as S
from pdserve.router.node_messages import PREFILLING
from pdserve.router.registry import LIVE, NodeInfo

if TYPE_CHECKING:
    from pdserve.router.core import Flight

log = logging.getLogger(__name__)

RETRY_WAIT_S = 0.05        # the first pause before looking for a prefill node again
MAX_WAIT_RETRY_S = 1.0     # the longest pause between looks for a prefill node

# A PrefillBatch header stays under this (MAX_HEADER_BYTES is the hard limit): bigger
# batches leave as several messages.
MAX_BATCH_BYTES = P.MAX_HEADER_BYTES // 2


def request_bytes(req: P.PrefillRequest) -> int:
    """A bound on a PrefillRequest's share of a msgpack header (an int packs in <= 9 bytes;
    token ids below 2^32 in <= 5)."""
    return 512 + 5 * len(req.prompt_token_ids) + 9 * len(req.sampling.stop_token_ids) \
        + len(req.req_id) + len(req.decode_node_id) + len(req.kv_address) \
        + len(req.decode_host_id)


def split_by_size(requests: list[P.PrefillRequest], limit: int) -> list[list[P.PrefillRequest]]:
    """Consecutive parts of ``requests``, each under ``limit`` bytes by request_bytes (a
    request over the limit on its own is a part of its own: the send refuses it)."""
    parts, part, size = [], [], 0
    for r in requests:
        n = request_bytes(r)
        if part and size + n > limit:
            parts.append(part)
            part, size = [], 0
        part.append(r)
        size += n
    if part:
        parts.append(part)
    return parts


def prefill_timeout(deadline: float, lease_s: float, colocated: bool) -> float:
    """A PrefillRequest's timeout_s: the request's time left. A prefill node waits this long
    for the decode node's KV acknowledgement after the first token, so there it is at most
    the reservation's lease: an unreachable decode node must not hold the request until
    its deadline."""
    left = max(1.0, deadline - time.monotonic())
    return left if colocated else min(left, lease_s)


class PrefillDispatch:
    """Needs RouterCore's registry, policy, flights, metrics, config, _send, _retry and
    _fail."""

    def _pick_prefill(self, flight: Flight) -> NodeInfo | None:
        """The prefill node for this attempt; None: there is none, and the flight waits
        (one may join) until the deadline, looking less often the longer it takes."""
        nodes = self.registry.live("prefill")
        if nodes:
            return self.policy.pick("prefill", nodes, flight.wire_prompt)
        flight.waits += 1
        self._retry(flight, "no live prefill node", count=False,
                    delay=min(MAX_WAIT_RETRY_S, RETRY_WAIT_S * 2 ** flight.waits))
        return None

    def _to_prefill(self, flight: Flight, node: NodeInfo | None = None) -> None:
        decode = self.registry.nodes.get(flight.decode_node)
        node = node or self.registry.nodes.get(flight.prefill_node)
        if node is None or decode is None or node.state != LIVE:
            # The decode node takes KV only from the node its reservation names.
            self._retry(flight, "its prefill node left during the reservation", count=False)
            return
        flight.prefill_node, flight.state = node.node_id, PREFILLING
        node.requests.add(flight.wire_id)
        node.queued_prompt_tokens += len(flight.wire_prompt)
        self._batches.setdefault(node.node_id, []).append(P.PrefillRequest(
            req_id=flight.wire_id, prompt_token_ids=flight.wire_prompt, sampling=flight.spec,
            decode_node_id=decode.node_id, kv_address=decode.hello.kv_address or "",
            timeout_s=prefill_timeout(flight.deadline, self.config.reserve_lease_s,
                                      colocated=node is decode),
            skip_blocks=flight.skip_blocks, decode_host_id=decode.hello.host_id))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Everything bound for one prefill node in this loop turn leaves as one message
        (several when that would pass MAX_BATCH_BYTES)."""
        self._flush_scheduled = False
        batches, self._batches = self._batches, {}
        for node_id, requests in batches.items():
            for part in split_by_size(requests, MAX_BATCH_BYTES):
                if request_bytes(part[0]) > MAX_BATCH_BYTES:  # alone, and still too big
                    self._fail(self.flights[part[0].req_id], S.BAD_REQUEST, (
                        f"the request needs a {request_bytes(part[0])}-byte message to its "
                        f"prefill node, over the {MAX_BATCH_BYTES}-byte limit"))
                    continue
                try:
                    self._send_batch(node_id, part)
                except Exception:  # these requests fail; the other batches still leave
                    self.metrics.internal_error("router.flush", log)
                    for r in part:
                        if r.req_id in self.flights:
                            self._fail(self.flights[r.req_id], S.INTERNAL,
                                       "internal error while dispatching; see the router's log")

    def _send_batch(self, node_id: str, requests: list[P.PrefillRequest]) -> None:
        self.metrics.dispatched(self.flights[r.req_id].req_id for r in requests
                                if r.req_id in self.flights)
        if not self._send(node_id, P.PrefillBatch(requests=requests)):
            for r in requests:
                if r.req_id in self.flights:
                    self._retry(self.flights[r.req_id],
                                f"prefill node {node_id} could not be reached")
