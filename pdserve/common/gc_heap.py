"""The objects a process made while starting (modules, the model, the tokenizer), out of
the cyclic garbage collector's way.

They live as long as the process, yet every full collection walks all of them again:
about 190,000 objects in the router after its imports (58 ms a full collection on the
2-core dev machine), several times that once a tokenizer and a model are loaded. Young
objects of the requests in flight are collected as before.
"""
from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_objects() -> None:
    """Collects once, then moves every object alive now to the permanent generation
    (``gc.freeze``): call when start-up is over, before serving."""
    gc.collect()
    gc.freeze()
    log.debug("%d start-up objects frozen out of the garbage collector's way",
              gc.get_freeze_count())
