"""What leaves per node per turn: the reservations one decode node got since the last
flush leave as Reserve messages, and the requests one prefill node got as PrefillBatch
messages, each under the protocol's header limit. Pure (no sockets, no clock; it reads
the flights, never changes them): the dispatch holds a ``Batcher``, queues into it as
attempts are placed, and empties it in its ``flush``, which control.py calls once per
event-loop turn."""
from __future__ import annotations

import msgspec

from pdserve.common import protocol as P
from pdserve.router.dispatch.flight import Flight, State

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


class Batcher:
    """What waits for the next flush, per node: reservations by decode node, prefill
    requests by prefill node, in the order they were queued."""

    def __init__(self) -> None:
        self._reservations: dict[str, list[P.ReserveRequest]] = {}
        self._batches: dict[str, list[P.PrefillRequest]] = {}

    def has_batches(self) -> bool:
        """Whether reservations or requests wait for ``take``."""
        return bool(self._batches or self._reservations)

    def reserve(self, node_id: str, item: P.ReserveRequest) -> None:
        self._reservations.setdefault(node_id, []).append(item)

    def prefill(self, node_id: str, item: P.PrefillRequest) -> None:
        self._batches.setdefault(node_id, []).append(item)

    def take(self, flights: dict[str, Flight]
             ) -> tuple[list[tuple[str, P.Reserve | P.PrefillBatch]], list[tuple[str, str]]]:
        """Everything queued since the last take: ``(messages, too_big)``. ``messages``:
        (node id, message), one per node (several when one would pass MAX_BATCH_BYTES),
        reservations first, then prefill batches; items no longer meant for their node
        (by ``flights``, wire id -> Flight: the request ended or moved) are left out.
        ``too_big``: (wire id, why) of items over the limit on their own."""
        def reserving_on(wire_id: str, node_id: str) -> bool:
            flight = flights.get(wire_id)
            return flight is not None and flight.state is State.RESERVING \
                and flight.decode_node == node_id

        def queued_on(wire_id: str, node_id: str) -> bool:
            flight = flights.get(wire_id)
            return flight is not None and flight.state is State.PREFILLING \
                and flight.prefill_node == node_id

        reservations, self._reservations = self._reservations, {}
        batches, self._batches = self._batches, {}
        messages: list = []
        too_big: list[tuple[str, str]] = []
        for node_id, items in reservations.items():
            for part in _parts(items, node_id, reserving_on, "decode", too_big):
                messages.append((node_id, P.Reserve(items=part)))
        for node_id, requests in batches.items():
            for part in _parts(requests, node_id, queued_on, "prefill", too_big):
                messages.append((node_id, P.PrefillBatch(requests=part)))
        return messages, too_big


def _parts(items: list, node_id: str, still_on, role: str, too_big: list):
    """The items still meant for ``node_id``, in messages under MAX_BATCH_BYTES; an item
    too big alone goes to ``too_big``."""
    items = [r for r in items if still_on(r.req_id, node_id)]
    for part in split_by_size(items, MAX_BATCH_BYTES):
        if request_bytes(part[0]) > MAX_BATCH_BYTES:  # alone, and still too big
            too_big.append((part[0].req_id, (
                f"the request needs a {request_bytes(part[0])}-byte message to its "
                f"{role} node, over the {MAX_BATCH_BYTES}-byte limit")))
            continue
        yield part
