"""Per-peer message budgets: a peer that floods a socket is slowed down to its budget
before its messages cost a decode, a lookup or a reply.

Token buckets: each message takes one token; a bucket refills at ``rate`` per second up
to ``burst``. Known peers (registered nodes) get a bucket each; peers nobody knows share
one small bucket, since a peer can mint a fresh socket identity for every message.
Both are bounded in memory.
"""
from __future__ import annotations

import time
from typing import Callable


class Bucket:
    __slots__ = ("rate", "burst", "tokens", "stamp")

    def __init__(self, rate: float, burst: float, now: float):
        self.rate, self.burst, self.tokens, self.stamp = rate, burst, burst, now

    def take(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class PeerBudgets:
    """``admit(peer)``: True if the peer's message may be handled, False to drop it.

    ``known(peer)`` says whether the peer has its own bucket (``rate``/``burst``);
    the others share the ``stranger_rate``/``stranger_burst`` bucket. At most
    ``max_peers`` buckets are kept (the least recently created go first)."""

    def __init__(self, known: Callable[[bytes], bool], *, rate: float, burst: float,
                 stranger_rate: float, stranger_burst: float, max_peers: int = 4096,
                 clock: Callable[[], float] = time.monotonic):
        self._known = known
        self._rate, self._burst, self._max = rate, burst, max_peers
        self._clock = clock
        self._strangers = Bucket(stranger_rate, stranger_burst, clock())
        self._buckets: dict[bytes, Bucket] = {}

    def admit(self, peer: bytes) -> bool:
        now = self._clock()
        if not self._known(peer):
            return self._strangers.take(now)
        bucket = self._buckets.get(peer)
        if bucket is None:
            if len(self._buckets) >= self._max:
                del self._buckets[next(iter(self._buckets))]
            bucket = self._buckets[peer] = Bucket(self._rate, self._burst, now)
        return bucket.take(now)

    def forget(self, peer: bytes) -> None:
        self._buckets.pop(peer, None)
