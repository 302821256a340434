"""Waiting on a request's choices while the HTTP client may go away, and sending an SSE
body: the two pieces of api.py that touch the ASGI connection itself."""
from __future__ import annotations

import asyncio

from fastapi import Request, Response
from starlette.requests import ClientDisconnect

from pdserve.router.http.choices import Choice, Choices
from pdserve.router.streams import StreamEvent


class ClientWatch:
    """Races waits on a request's choices against the client's disconnect (an ASGI
    receive): one waiter at a time, woken by an event or by the disconnect, and no wait at
    all when an event is already there."""

    def __init__(self, request: Request):
        self._waiter: asyncio.Future | None = None
        self._gone = asyncio.ensure_future(self._wait(request.receive))
        self._gone.add_done_callback(self._wake)

    @staticmethod
    async def _wait(receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    def _wake(self, _) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    @property
    def gone(self) -> bool:
        return self._gone.done()

    async def next(self, choices: Choices) -> tuple[Choice, StreamEvent] | None:
        """The next (choice, events), or None when the client went away or the choices
        ended."""
        while (item := choices.take()) is None:
            if choices.ended or self.gone:
                return None
            self._waiter = choices.wakeup()
            await self._waiter
        return item

    def close(self, choices: Choices) -> None:
        self._gone.cancel()
        choices.cancel()  # a no-op once the streams ended


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStream(Response):
    """A text/event-stream response from an async iterator of bytes, each sent as it comes.
    Starlette's StreamingResponse would also run a task group listening for the disconnect
    (ClientWatch already does) and ``background`` in a thread pool; ``on_close`` runs here,
    on the loop, whether or not the body was ever iterated. A piece ending with ``last``
    (the stream's final event) closes the body in the same write; with ``last`` None
    (a stream with no fixed last bytes) an empty write closes it."""

    media_type = "text/event-stream"

    def __init__(self, body, headers: dict, on_close, last: bytes | None):
        self.body_iterator, self.on_close, self.last = body, on_close, last
        self.status_code, self.background = 200, None
        self.init_headers(headers)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": self.raw_headers})
            more = True
            async for chunk in self.body_iterator:
                more = self.last is None or not chunk.endswith(self.last)
                await send({"type": "http.response.body", "body": chunk, "more_body": more})
            if more:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            raise ClientDisconnect() from None
        finally:
            self.on_close()
