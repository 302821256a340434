"""What leaves per node per turn: which prefill node an attempt goes to, and how the
reservations one decode node got since the last flush leave as Reserve messages, and
the requests one prefill node got as PrefillBatch messages, each under the protocol's
header limit. Pure (no sockets, no clock): ``PrefillDispatch`` is part of
dispatch.Dispatch, and control.py calls ``flush`` once per event-loop turn."""
from __future__ import annotations

import logging

import msgspec

from pdserve.common import protocol as P
from pdserve.router import streams as S
from pdserve.router.flight import Flight, State
from pdserve.router.registry import LIVE, NodeInfo

log = logging.getLogger(__name__)

RETRY_WAIT_S = 0.05        # the first pause before looking for a prefill node again
MAX_WAIT_RETRY_S = 1.0     # the longest pause between looks for a prefill node

# A PrefillBatch header stays under this (MAX_HEADER_BYTES is the hard limit): bigger
# batches leave as several messages.
MAX_BATCH_BYTES = P.MAX_HEADER_BYTES // 2


def request_bytes(req: P.PrefillRequest | P.ReserveRequest) -> int:
    """A bound on a request's share of a msgpack header (an int packs in <= 9 bytes; token
    ids below 2^32 in <= 5; a logit bias is an id and a float)."""
    sampling = req.sampling
    strings = sum(len(v) for v in msgspec.structs.astuple(req) if isinstance(v, str))
    guide = len(sampling.guide[1]) + 64 if sampling.guide is not None else 0
    return 512 + 5 * len(req.prompt_token_ids) + 9 * len(sampling.stop_token_ids) \
        + 18 * len(sampling.logit_bias) + guide + strings


def split_by_size(requests: list, limit: int) -> list[list]:
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


def prefill_timeout(deadline: float, now: float, lease_s: float, colocated: bool) -> float:
    """A PrefillRequest's timeout_s: the request's time left. A prefill node waits this long
    for the decode node's KV acknowledgement after the first token, so there it is at most
    the reservation's lease: an unreachable decode node must not hold the request until
    its deadline."""
    left = max(1.0, deadline - now)
    return left if colocated else min(left, lease_s)


class PrefillDispatch:
    """Needs Dispatch's registry, policy, flights, metrics, config, _batches, _reservations,
    _send, _retry and _fail."""

    def has_batches(self) -> bool:
        """Whether reservations or requests wait for ``flush``."""
        return bool(self._batches or self._reservations)

    def _pick_prefill(self, flight: Flight, now: float) -> NodeInfo | None:
        """The prefill node for this attempt; None: there is none, and the flight waits
        (one may join) until the deadline, looking less often the longer it takes."""
        nodes = self.registry.live("prefill")
        if nodes:
            return self.policy.pick("prefill", nodes, flight.wire_prompt)
        flight.waits += 1
        self._retry(flight, "no live prefill node", now, count=False,
                    delay=min(MAX_WAIT_RETRY_S, RETRY_WAIT_S * 2 ** flight.waits))
        return None

    def _to_prefill(self, flight: Flight, now: float, node: NodeInfo | None = None) -> None:
        decode = self.registry.nodes.get(flight.decode_node)
        node = node or self.registry.nodes.get(flight.prefill_node)
        if node is None or decode is None or node.state != LIVE:
            # The decode node takes KV only from the node its reservation names.
            self._retry(flight, "its prefill node left during the reservation", now,
                        count=False)
            return
        if flight.prefill_node is None:  # colocated: no reservation counted it yet
            node.queued_prompt_tokens += len(flight.wire_prompt)
        flight.prefill_node, flight.state = node.node_id, State.PREFILLING
        node.requests.add(flight.wire_id)
        self._batches.setdefault(node.node_id, []).append(P.PrefillRequest(
            req_id=flight.wire_id, prompt_token_ids=flight.wire_prompt, sampling=flight.spec,
            decode_node_id=decode.node_id, kv_address=decode.hello.kv_address or "",
            timeout_s=prefill_timeout(flight.deadline, now, self.config.reserve_lease_s,
                                      colocated=node is decode),
            skip_blocks=flight.skip_blocks, decode_host_id=decode.hello.host_id))

    def flush(self, now: float):
        """Everything queued for one node since the last flush leaves as one message
        (several when that would pass MAX_BATCH_BYTES): reservations first, then prefill
        batches. Requests that ended or moved meanwhile (cancelled, failed over) are left
        out."""
        reservations, self._reservations = self._reservations, {}
        for node_id, items in reservations.items():
            for part in self._parts(items, node_id, self._reserving_on, "decode"):
                self._send(node_id, P.Reserve(items=part))
        batches, self._batches = self._batches, {}
        for node_id, requests in batches.items():
            for part in self._parts(requests, node_id, self._queued_on, "prefill"):
                try:
                    self.metrics.dispatched(self.flights[r.req_id].req_id for r in part)
                    self._send(node_id, P.PrefillBatch(requests=part))
                except Exception:  # these requests fail; the other batches still leave
                    self.metrics.internal_error("router.flush", log)
                    for r in part:
                        if r.req_id in self.flights:
                            self._fail(self.flights[r.req_id], S.INTERNAL,
                                       "internal error while dispatching; see the router's log")
        return self.take()

    def _parts(self, items: list, node_id: str, still_on, role: str):
        """The items still meant for ``node_id`` (``still_on``), in messages under
        MAX_BATCH_BYTES; an item too big alone fails its request."""
        items = [r for r in items if still_on(r.req_id, node_id)]
        for part in split_by_size(items, MAX_BATCH_BYTES):
            if request_bytes(part[0]) > MAX_BATCH_BYTES:  # alone, and still too big
                self._fail(self.flights[part[0].req_id], S.BAD_REQUEST, (
                    f"the request needs a {request_bytes(part[0])}-byte message to its "
                    f"{role} node, over the {MAX_BATCH_BYTES}-byte limit"))
                continue
            yield part

    def _reserving_on(self, wire_id: str, node_id: str) -> bool:
        flight = self.flights.get(wire_id)
        return flight is not None and flight.state is State.RESERVING \
            and flight.decode_node == node_id

    def _queued_on(self, wire_id: str, node_id: str) -> bool:
        flight = self.flights.get(wire_id)
        return flight is not None and flight.state is State.PREFILLING \
            and flight.prefill_node == node_id
