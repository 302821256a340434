"""How the router cuts what one prefill node gets in one loop turn into messages that fit
the protocol's header limit (pure functions)."""
from __future__ import annotations

import time

from pdserve.common import protocol as P

# A PrefillBatch header stays under this (MAX_HEADER_BYTES is the hard limit): bigger
# batches leave as several messages.
MAX_BATCH_BYTES = P.MAX_HEADER_BYTES // 2


def request_bytes(req: P.PrefillRequest) -> int:
    """A bound on a PrefillRequest's share of a msgpack header (an int packs in <= 9 bytes;
    token ids below 2^32 in <= 5)."""
    return 512 + 5 * len(req.prompt_token_ids) + 9 * len(req.sampling.stop_token_ids) \
        + len(req.req_id) + len(req.decode_node_id) + len(req.kv_address)


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
