"""Structured-enough logs: one line per event, the process's role and id first."""
from __future__ import annotations

import logging
import sys
import time
from typing import Optional

LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LEVEL = "info"


def setup_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s {name} %(name)s: %(message)s",
        force=True,
    )


class LogThrottle:
    """One log line per key and period: a refused peer retries every 100 ms."""

    def __init__(self, period_s: float = 10.0):
        self.period_s = period_s
        self._seen: dict = {}  # key -> (last logged, suppressed since)

    def __call__(self, key) -> Optional[int]:
        now = time.monotonic()
        if len(self._seen) > 10_000:  # a peer cycling through fresh keys must not grow it
            self._seen.clear()
        last, count = self._seen.get(key, (-1e9, 0))
        if now - last < self.period_s:
            self._seen[key] = (last, count + 1)
            return None
        self._seen[key] = (now, 0)
        return count
