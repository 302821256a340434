"""What the router's dispatch keeps per request, and what each of its events returns.

A ``Flight`` is one client request across all its attempts; ``Output`` is what one
event made: messages for nodes, events for clients, and node messages dropped (so the
caller can log them, throttled). Plain data: no sockets, no clock.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.common import protocol as P
from pdserve.model.text import RequestOutputState
from pdserve.router import streams as S


class State(enum.Enum):
    WAITING = "waiting"        # no node could take it just now: tick tries again at retry_at
    RESERVING = "reserving"    # a Reserve is out to its decode node
    PREFILLING = "prefilling"  # queued for, or sent to, its prefill node; no first token yet
    DECODING = "decoding"      # the first token came; its decode node streams the rest


@dataclass
class Flight:
    req_id: str                 # the client's id
    wire_id: str                # this attempt's id on the wire
    prompt: list[int]           # the client's prompt
    spec: P.SamplingParams      # as nodes get it: for_nodes(), no stop strings
    out: RequestOutputState     # tokens and text the client has been given
    deadline: float
    created: float
    state: State = State.RESERVING
    prefill_node: str | None = None
    decode_node: str | None = None
    refused_by: set[str] = field(default_factory=set)
    retry_at: float = 0.0       # when WAITING: the time of the next try
    early_tokens: list[P.TokenItem] = field(default_factory=list)  # decode before prefill's
    attempt: int = 0            # dispatches so far, for wire ids
    failures: int = 0           # of them, the ones that failed (MAX_ATTEMPTS caps these)
    wire_prompt: list[int] = field(default_factory=list)  # prompt + tokens of earlier attempts
    skip_blocks: int = 0        # leading KV blocks the reserving decode node has cached
    waits: int = 0              # looks for a live prefill node that found none
    origin: tuple[str, str] | None = None  # a resumable stream's (producer, id): resume.py


@dataclass
class Output:
    """What one dispatch event decided. ``sends``: (node id, message), in order; a node
    id may be a raw socket identity (bytes) when answering a peer that never registered.
    ``events``: (client request id, event); a request's last event is terminal.
    ``dropped``: (node id, message kind, wire id, why) of node messages ignored."""
    sends: list[tuple[str | bytes, P.Message]] = field(default_factory=list)
    events: list[tuple[str, S.StreamEvent]] = field(default_factory=list)
    dropped: list[tuple[str, str, str, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.sends or self.events or self.dropped)


def merge_aborts(sends: list) -> list:
    """One Abort per node and reason per event: an Abort joins the node's latest message
    when that is an Abort for the same reason, so what each node sees keeps its order.
    One pass over the sends (a node's death can end thousands of requests at once)."""
    merged: list = []
    latest: dict = {}                    # node id -> index in merged of its last message
    ids: dict[int, list[str]] = {}       # index of an Abort in merged -> its request ids
    for node_id, msg in sends:
        j = latest.get(node_id)
        if isinstance(msg, P.Abort) and j in ids and merged[j][1].reason == msg.reason:
            ids[j].extend(msg.req_ids)
            continue
        latest[node_id] = len(merged)
        if isinstance(msg, P.Abort):
            ids[len(merged)] = list(msg.req_ids)
        merged.append((node_id, msg))
    for j, req_ids in ids.items():
        node_id, msg = merged[j]
        if len(req_ids) != len(msg.req_ids):
            merged[j] = (node_id, P.Abort(req_ids=req_ids, reason=msg.reason))
    return merged
