"""The router's store of Responses API responses (``store: true``), for
``GET /v1/responses/{id}`` and ``previous_response_id``: bounded in entries
(``--responses-store-max-entries``), in bytes (``--responses-store-max-bytes``: one
entry can hold a 4 MiB conversation, so a count alone does not bound memory), the oldest
dropped first, and in age (``--responses-store-ttl``). In the router's memory: a
response stored on one router replica is not known to another, and a router restart
forgets it.

Each entry keeps the response object and the conversation it ends, as chat messages
(the input turns, tool results included, then the response's own output with its
function calls as assistant ``tool_calls``), so that a follow-up request carries every
item forward (vllm#43244 lost the function_call items)."""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import orjson


@dataclass
class Stored:
    response: dict
    history: list[dict]     # chat messages, the instructions' system message excluded
    expires: float          # time.monotonic() deadline
    num_bytes: int          # the entry's JSON size, what the byte bound counts


class ResponsesStore:
    def __init__(self, max_entries: int, ttl_s: float, on_size=None,
                 max_bytes: int = 256 << 20):
        self.max_entries, self.ttl_s, self.max_bytes = max_entries, ttl_s, max_bytes
        self._entries: OrderedDict[str, Stored] = OrderedDict()   # oldest first
        self._on_size = on_size or (lambda n: None)
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict, history: list[dict]) -> None:
        size = len(orjson.dumps(response)) + len(orjson.dumps(history))
        if self.max_entries == 0 or size > self.max_bytes:
            return
        self._expire()
        self._drop(response["id"])
        self._entries[response["id"]] = Stored(response, history,
                                               time.monotonic() + self.ttl_s, size)
        self.num_bytes += size
        while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._on_size(len(self._entries))

    def get(self, response_id: str) -> Stored | None:
        self._expire()
        return self._entries.get(response_id)

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.num_bytes -= entry.num_bytes

    def _expire(self) -> None:
        # Entries are in insertion order with one TTL, so the expired ones lead.
        now, before = time.monotonic(), len(self._entries)
        while self._entries:
            oldest_id, oldest = next(iter(self._entries.items()))
            if oldest.expires > now:
                break
            self._drop(oldest_id)
        if len(self._entries) != before:
            self._on_size(len(self._entries))
