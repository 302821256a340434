"""A decode node's streams, kept until their client can have them: a stream outlives its
router (issue 31; docs/queue-protocol.md, "Resuming a stream").

A stream is resumable when its Reserve carried a ``StreamOrigin`` (the queue ingress's
requests: the producer's identity and id, the client's own sampling). The node then
answers a router's ``Resume`` for (producer, id) with every token the stream has made, and
sends its later tokens to that router. Why the node keeps a stream until its end plus
``keep_s``, rather than until a router acks what its client got: an ack per step per
stream would double the control traffic of every stream to save memory that only the
last ``keep_s`` of ended streams use, and a router that acks is the router that may die
between its ack and its flush. The node cannot know what the client got; the client
does, and says it in its resume (its token count), so the node keeps everything and the
router sends only the rest.

The bounds, per node:
- a running stream whose router is gone (left the cluster, or restarted) keeps decoding
  for ``keep_s``; no router resumed it by then: it is aborted and its blocks freed (its
  own deadline still applies too);
- an ended stream (its tokens and finish reason) is kept ``keep_s`` after its end, and
  of those at most MAX_KEPT_STREAMS streams and MAX_KEPT_TOKENS tokens (prompts
  included, 4 bytes each): past either the oldest go first;
- a running stream is the engine's: its tokens are its sequence's, not copied.

Plain data, owned by the compute loop (no sockets, no clock reads: ``now`` is passed).
"""
from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from pdserve.common import protocol as P

log = logging.getLogger(__name__)

MAX_KEPT_STREAMS = 10_000      # ended streams kept per node
MAX_KEPT_TOKENS = 4_000_000    # their tokens (prompt + output), 4 bytes each: 16 MB


@dataclass
class Ended:
    origin: P.StreamOrigin
    tokens: array              # the attempt's prompt + outputs ('i': token ids < 2^31)
    finish_reason: str
    at: float


class StreamKeeper:
    def __init__(self, keep_s: float):
        self.keep_s = keep_s
        self.wire_ids: dict[tuple[str, str], str] = {}   # (owner, client id) -> wire id
        self.keys: dict[str, tuple[str, str]] = {}       # and back
        self.ended: OrderedDict[str, Ended] = OrderedDict()  # by wire id, oldest first
        self.orphans: dict[str, float] = {}   # running wire id -> when its router went
        self.num_kept_tokens = 0

    @staticmethod
    def key(origin: P.StreamOrigin) -> tuple[str, str]:
        return origin.owner, origin.client_id

    def started(self, wire_id: str, origin: P.StreamOrigin) -> None:
        """A resumable stream is reserved here (a new attempt of one replaces the old)."""
        old = self.wire_ids.get(self.key(origin))
        if old is not None and old != wire_id:
            self.forget(old)
        self.wire_ids[self.key(origin)] = wire_id
        self.keys[wire_id] = self.key(origin)

    def find(self, owner: str, client_id: str) -> str | None:
        return self.wire_ids.get((owner, client_id))

    def finished(self, wire_id: str, origin: P.StreamOrigin, tokens: list[int],
                 finish_reason: str, now: float) -> None:
        """The stream ended on the engine: its tokens are kept for a resume."""
        self.orphans.pop(wire_id, None)
        self._forget_ended(wire_id)
        self.ended[wire_id] = Ended(origin, array("i", tokens), finish_reason, now)
        self.num_kept_tokens += len(tokens)
        while self.ended and (len(self.ended) > MAX_KEPT_STREAMS
                              or self.num_kept_tokens > MAX_KEPT_TOKENS):
            self.forget(next(iter(self.ended)))

    def forget(self, wire_id: str) -> None:
        """Aborted, failed, or past its bound: nothing of it is kept."""
        self.orphans.pop(wire_id, None)
        self._forget_ended(wire_id)
        key = self.keys.pop(wire_id, None)
        if key is not None and self.wire_ids.get(key) == wire_id:
            del self.wire_ids[key]

    def _forget_ended(self, wire_id: str) -> Ended | None:
        ended = self.ended.pop(wire_id, None)
        if ended is not None:
            self.num_kept_tokens -= len(ended.tokens)
        return ended

    def orphaned(self, wire_id: str, now: float) -> None:
        self.orphans.setdefault(wire_id, now)

    def adopted(self, wire_id: str) -> None:
        """A router took the stream over: it is nobody's orphan now."""
        self.orphans.pop(wire_id, None)

    def expired(self, now: float) -> list[str]:
        """Running orphans past ``keep_s`` (the caller aborts them); ended streams past it
        are forgotten here."""
        while self.ended:
            wire_id, ended = next(iter(self.ended.items()))
            if now - ended.at <= self.keep_s:
                break
            self.forget(wire_id)
        return [w for w, since in self.orphans.items() if now - since > self.keep_s]
