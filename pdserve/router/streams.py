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
from typing import Callable

from pdserve.common.errors import (  # noqa: F401 (the front-ends' names: S.BAD_REQUEST)
    BAD_REQUEST,
    HTTP_STATUS,
    INTERNAL,
    NO_NODES,
    NODE_ERROR,
    NOT_FOUND,
    OVERLOADED,
    STREAM_MOVED,
    STREAM_NOT_FOUND,
    TIMEOUT,
)
from pdserve.common.logprobs import join
from pdserve.common.protocol import Logprobs
from pdserve.common.sampling import SamplingParams


class RequestError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.counted = False  # in pdserve_request_errors_total already (RouterCore.refused)

    @property
    def http_status(self) -> int:
        return HTTP_STATUS.get(self.code, 500)


@dataclass
class GenerationRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str | None = None      # None: the router makes one
    timeout_s: float | None = None     # None: the router's default deadline
    # (producer identity hex, the producer's id) of a queue request: its decode node keeps
    # its stream for a resume on another router (docs/queue-protocol.md); None: not kept
    origin: tuple[str, str] | None = None


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
    stop_str: str | None = None        # on the last event: the stop string that ended it

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def then(self, later: "StreamEvent") -> "StreamEvent":
        """This event followed by ``later``, as one (a reader that fell behind gets one)."""
        return StreamEvent(self.token_ids + later.token_ids, self.text + later.text,
                           later.finish_reason, later.error,
                           later.prompt_tokens or self.prompt_tokens,
                           later.completion_tokens or self.completion_tokens,
                           join([lp for lp in (self.logprobs, later.logprobs) if lp])
                           if self.logprobs or later.logprobs else None,
                           self.prompt_logprobs or later.prompt_logprobs, later.stop_str)


@dataclass
class RequestStream:
    """One request's events, in order; async-iterate it, or set ``sink`` to have each event
    handed over as it comes (no task per request). ``cancel()`` aborts it on the nodes.

    Events a reader has not taken yet are merged into one: a slow reader holds one event,
    however many tokens arrive, and takes them all in its next turn."""
    request_id: str
    prompt_token_ids: list[int]
    created: float = field(default_factory=time.time)
    sink: Callable[[StreamEvent], None] | None = field(default=None, repr=False)
    _pending: StreamEvent | None = field(default=None, repr=False)
    _waiter: asyncio.Future | None = field(default=None, repr=False)
    _cancel: object = field(default=None, repr=False)
    done: bool = False

    def push(self, event: StreamEvent) -> None:
        if self.done:
            return
        self.done = event.is_last
        if self.sink is not None:
            self.sink(event)
            return
        self._pending = event if self._pending is None else self._pending.then(event)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def cancel(self) -> None:
        if not self.done and self._cancel is not None:
            self._cancel(self.request_id)

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamEvent:
        while self._pending is None:
            if self.done:
                raise StopAsyncIteration
            await self.wakeup()
        return self.take()

    def take(self) -> StreamEvent | None:
        """The events not taken yet, merged into one; None when there are none (never
        waits)."""
        event, self._pending = self._pending, None
        return event

    @property
    def ended(self) -> bool:
        """The last event arrived and was taken."""
        return self.done and self._pending is None

    def wakeup(self) -> asyncio.Future:
        """A future set when the next event arrives (a reader awaits it, then takes)."""
        self._waiter = asyncio.get_running_loop().create_future()
        return self._waiter
