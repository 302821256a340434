"""Stand-in servers that answer at once: what a benchmark client reaches with no server
work behind it (its ceiling), and a fixed peer for the client's own tests."""
from __future__ import annotations


def sse_app(pieces: list[bytes]):
    """An ASGI app answering every HTTP request, once its body is read, with 200
    text/event-stream and ``pieces``, each its own body write."""
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for body in pieces:
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    return app
