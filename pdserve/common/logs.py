"""Structured-enough logs: one line per event, the process's role and id first."""
from __future__ import annotations

import logging
import sys

LEVELS = ("debug", "info", "warning", "error")


def setup_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s {name} %(name)s: %(message)s",
        force=True,
    )
