"""The router's clock: liveness of nodes, heartbeats, deadlines and retries, every TICK_S.

Mixed into RouterCore. No failure of one turn stops the clock, and a router that was
itself stalled (SIGSTOP, swapped out) does not blame the nodes for its own silence.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from pdserve.common import protocol as P
from pdserve.router import streams as S

if TYPE_CHECKING:
    from pdserve.router.core import Flight

log = logging.getLogger(__name__)

TICK_S = 0.05              # deadlines, heartbeats and dead nodes are checked this often


class Clock:
    async def _tick_loop(self) -> None:
        next_beat = 0.0
        while True:
            await asyncio.sleep(TICK_S)
            try:
                next_beat = self._tick(next_beat)
            except Exception:  # the clock must keep going: deadlines, liveness, heartbeats
                self.metrics.internal_error("router.tick", log)
            self.loop_ticks["tick"] += 1

    def _tick(self, next_beat: float) -> float:
        now = time.monotonic()
        stalled, self.last_tick = now - self.last_tick, now
        if stalled > self.registry.timeout_s / 2:
            # This process was stalled (stopped, swapped out): the nodes' silence is ours.
            # Their heartbeats wait unread in the socket; give them a fresh window.
            log.warning("the router's loop stalled for %.1f s: no node is blamed for it",
                        stalled)
            for node in self.registry.nodes.values():
                node.last_seen = max(node.last_seen, now)
        for node in self.registry.expire(now):
            self._node_gone(node, f"node {node.node_id} missed {self.config.liveness} "
                            "heartbeats")
        if now >= next_beat:
            next_beat = now + self.config.heartbeat_interval_s
            for node_id in list(self.registry.nodes):
                self._send(node_id, P.Heartbeat(node_id="router", stats=None))
        for flight in list(self.requests.values()):
            try:
                self._tick_flight(flight, now)
            except Exception:  # this request fails; the others are still looked at
                self.metrics.internal_error("router.tick.request", log)
                self._fail(flight, S.INTERNAL, "internal error; see the router's log")
        return next_beat

    def _tick_flight(self, flight: Flight, now: float) -> None:
        if now > flight.deadline:
            waiting = "no node could take it" if flight.retry_at else flight.state
            if flight.waits:
                waiting += f" (looked {flight.waits} times for a live prefill node)"
            self._fail(flight, S.TIMEOUT, f"the request passed its deadline "
                       f"({flight.deadline - flight.created:.0f} s) while {waiting}")
        elif flight.retry_at and now >= flight.retry_at:
            self._reserve(flight)
