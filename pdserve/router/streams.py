"""What the front-ends (HTTP, queue ingress) and the router core exchange.

A front-end checks and tokenizes a request, calls ``RouterCore.submit`` (which
never waits on a socket) and iterates the returned ``RequestStream``; every
stream ends with exactly one terminal event: ``finish_reason`` set, or
``error`` set. Streams are independent: one finishing, failing or being
cancelled never touches another.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pdserve.common.protocol import Logprobs
from pdserve.engine.sampling_params import SamplingParams

# Error codes a client sees (HTTP status in brackets).
BAD_REQUEST = "bad_request"          # [400] the request itself is wrong
NOT_FOUND = "model_not_found"        # [404] unknown model name
OVERLOADED = "overloaded"            # [429] queues full: retry later
NO_NODES = "no_nodes"                # [503] no live prefill or decode node
TIMEOUT = "timeout"                  # [504] the request's deadline passed
NODE_ERROR = "node_error"            # [500] a node failed the request
INTERNAL = "internal"                # [500] a bug; logged with its traceback
HTTP_STATUS = {BAD_REQUEST: 400, NOT_FOUND: 404, OVERLOADED: 429, NO_NODES: 503,
               TIMEOUT: 504, NODE_ERROR: 500, INTERNAL: 500}


class RequestError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param

    @property
    def http_status(self) -> int:
        return HTTP_STATUS.get(self.code, 500)


@dataclass
class GenerationRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str | None = None      # None: the router makes one
    timeout_s: float | None = None     # None: the router's default deadline


@dataclass
class StreamEvent:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None   # "stop" | "length" | "abort" on the last event
    error: RequestError | None = None  # set on a terminal error event instead
    prompt_tokens: int = 0
    completion_tokens: int = 0         # running total
    # protocol.Logprobs, when the request asked: of token_ids, and (on the first event) of
    # prompt tokens 1..
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class RequestStream:
    """One request's events, in order; async-iterate it. ``cancel()`` aborts it on the nodes."""
    request_id: str
    prompt_token_ids: list[int]
    created: float = field(default_factory=time.time)
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue, repr=False)
    _cancel: object = field(default=None, repr=False)
    done: bool = False

    def push(self, event: StreamEvent) -> None:
        if self.done:
            return
        self.done = event.is_last
        self._queue.put_nowait(event)

    def cancel(self) -> None:
        if not self.done and self._cancel is not None:
            self._cancel(self.request_id)

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamEvent:
        if self.done and self._queue.empty():
            raise StopAsyncIteration
        return await self._queue.get()
