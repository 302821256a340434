"""OpenAI's Responses API, an adapter over chat completions: ``POST /v1/responses``
translates its request into a chat body (responses_input.py), runs it through the one
path every generating endpoint takes (``api.run``), and maps the chat answer back: a
response object, or Responses' named SSE events (``response.created``,
``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``/``.done``, ``response.function_call_arguments.delta``/
``.done``, ``response.output_item.done``, ``response.completed``, each with its
``sequence_number``). ``GET /v1/responses/{id}`` reads the bounded store
(responses_store.py). Errors are OpenAI's error body."""
from __future__ import annotations

import logging
import time
import uuid

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from pdserve.common.errors import RESPONSE_NOT_FOUND
from pdserve.router.http.answers import ClientGone
from pdserve.router.http.chat_reading import (
    ARGS,
    CALL,
    TEXT,
    Call,
    ChatFailed,
    Turn,
    full_turn,
    renamed,
    stream_steps,
)
from pdserve.router.http.openai_schema import bad
from pdserve.router.http.responses_input import chat_body, chat_names
from pdserve.router.http.responses_store import ResponsesStore
from pdserve.router.http.wait import SSE_HEADERS, EventStream
from pdserve.router.streams import INTERNAL, RequestError

logger = logging.getLogger(__name__)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def shell(body: dict, response_id: str) -> dict:
    """The response object before any output: the request's settings echoed, as
    OpenAI's is."""
    return {"id": response_id, "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "model": body.get("model"), "output": [],
            "instructions": body.get("instructions"), "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": body.get("previous_response_id"),
            "store": body.get("store", True) is not False,
            "text": body.get("text") or {"format": {"type": "text"}},
            "metadata": body.get("metadata") or {}, "truncation": "disabled",
            "reasoning": None, "user": body.get("user"), "error": None,
            "incomplete_details": None, "usage": None}


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [] if status == "in_progress" else [_text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": content}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call: Call, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": "" if status == "in_progress" else call.arguments, "status": status}


def finished(head: dict, items: list[dict], turn: Turn) -> dict:
    """The response object once its turn ended."""
    incomplete = turn.finish_reason == "length"
    return {**head, "status": "incomplete" if incomplete else "completed", "output": items,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "usage": {"input_tokens": turn.prompt_tokens,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": turn.completion_tokens,
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": turn.prompt_tokens + turn.completion_tokens}}


def last_status(turn: Turn) -> str:
    """The status of a turn's last output item: the one max_output_tokens cut, if any
    (an agent must not run a call whose arguments were cut short)."""
    return "incomplete" if turn.finish_reason == "length" else "completed"


def full_items(turn: Turn) -> list[dict]:
    items = [message_item(_id("msg"), turn.text)] if turn.text or not turn.calls else []
    items += [call_item(_id("fc"), c) for c in turn.calls]
    items[-1]["status"] = last_status(turn)
    return items


def assistant_message(turn: Turn) -> dict:
    """The turn as the chat message a follow-up request's history holds."""
    message = {"role": "assistant", "content": turn.text}
    if turn.calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.name, "arguments": c.arguments}} for c in turn.calls]
    return message


class EventWriter:
    """Responses' SSE events of one streamed response, numbered as they leave."""

    def __init__(self, head: dict):
        self.head, self.seq = head, 0
        self.items: list[dict] = []        # output items, finished ones in final form
        self.open: tuple[dict, Call | None] | None = None   # the item being written

    def event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def where(self) -> dict:
        return {"item_id": self.open[0]["id"], "output_index": len(self.items) - 1}

    def add(self, item: dict, call: Call | None) -> bytes:
        out = self.close()
        self.items.append(item)
        self.open = (item, call)
        out += self.event("response.output_item.added", output_index=len(self.items) - 1,
                          item=item)
        if call is None:
            out += self.event("response.content_part.added", **self.where(),
                              content_index=0, part=_text_part(""))
        return out

    def close(self, text: str = "", status: str = "completed") -> bytes:
        """Ends the open item: ``text`` is the whole text of a message item."""
        if self.open is None:
            return b""
        (item, call), where = self.open, self.where()
        if call is None:
            out = self.event("response.output_text.done", **where, content_index=0,
                             text=text, logprobs=[])
            out += self.event("response.content_part.done", **where, content_index=0,
                              part=_text_part(text))
            done = message_item(item["id"], text, status)
        else:
            out = self.event("response.function_call_arguments.done", **where,
                             name=call.name, arguments=call.arguments)
            done = call_item(item["id"], call, status)
        self.items[-1], self.open = done, None
        return out + self.event("response.output_item.done", output_index=where[
            "output_index"], item=done)


async def stream_events(stream, head: dict, on_done):
    """The SSE body of a streamed response; ``on_done(response, turn)`` gets the final
    response object (to store it)."""
    writer, turn = EventWriter(head), Turn()
    text_start = 0                     # where the open message item's text starts
    yield writer.event("response.created", response=head) + \
        writer.event("response.in_progress", response=head)
    try:
        async for step in stream_steps(stream.chunks(), turn):
            out = b""
            if step[0] == TEXT:
                if writer.open is None or writer.open[1] is not None:
                    out += writer.close()
                    text_start = len(turn.text) - len(step[1])
                    out += writer.add(message_item(_id("msg"), "", "in_progress"), None)
                out += writer.event("response.output_text.delta", **writer.where(),
                                    content_index=0, delta=step[1], logprobs=[])
            elif step[0] == CALL:
                out += writer.close(turn.text[text_start:])
                out += writer.add(call_item(_id("fc"), step[1], "in_progress"), step[1])
            elif step[0] == ARGS and writer.open and writer.open[1] is step[1]:
                out += writer.event("response.function_call_arguments.delta",
                                    **writer.where(), delta=step[2])
            if out:
                yield out
    except Exception as e:  # ChatFailed: the chat stream's error; else a bug, logged
        if isinstance(e, ChatFailed):
            err = e.error
        else:
            logger.exception("response %s failed while streaming", head["id"])
            err = RequestError(INTERNAL, "internal error while streaming; see the router's "
                                         "log")
        failed = {**head, "status": "failed", "error": {"code": err.code,
                                                        "message": err.message}}
        yield writer.event("error", code=err.code, message=err.message, param=err.param) + \
            writer.event("response.failed", response=failed)
        return
    out = writer.close(turn.text[text_start:], last_status(turn))
    if not writer.items:  # nothing was written: still one (empty) message, as full_items
        out += writer.add(message_item(_id("msg"), "", "in_progress"), None) + \
            writer.close("", last_status(turn))
    response = finished(head, writer.items, turn)
    on_done(response, turn)
    # response.completed even when the status is incomplete (cut at max_output_tokens),
    # as vLLM does: the openai SDK's stream helper and openai-agents wait for this event.
    yield out + writer.event("response.completed", response=response)


def add_responses_routes(app: FastAPI, core, authorize, read_json, run, error_response):
    """POST /v1/responses and GET /v1/responses/{id} on ``app``; returns the POST handler
    (api.HotRoutes serves it directly). ``run`` is api.run, the chat path;
    ``error_response`` answers a RequestError in OpenAI's shape."""
    config = core.config
    store = ResponsesStore(config.responses_store_max_entries, config.responses_store_ttl_s,
                           core.metrics.responses_stored.set,
                           config.responses_store_max_bytes)

    def refuse(err: RequestError) -> Response:
        core.refused(err)
        return error_response(err)

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        response_id = _id("resp")
        try:
            authorize(request)
            body = await read_json(request)
            history = []
            previous = body.get("previous_response_id")
            if previous is not None:
                if not isinstance(previous, str):  # a malformed id, not an unknown one
                    raise bad(f"previous_response_id must be a string (a response's id), "
                              f"got {type(previous).__name__}", "previous_response_id")
                stored = store.get(previous)
                if stored is None:
                    raise RequestError(RESPONSE_NOT_FOUND, f"previous_response_id "
                                       f"{previous!r} names no stored response (never "
                                       "stored, or expired: --responses-store-ttl, "
                                       "--responses-store-max-entries)",
                                       "previous_response_id")
                history = stored.history
            if body.get("store") not in (None, True, False):
                raise bad("store must be a boolean", "store")
            chat, conversation = chat_body(body, history, response_id)
        except RequestError as e:
            return refuse(e)
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception:
            logger.exception("response %s failed before it was submitted", response_id)
            return refuse(RequestError(INTERNAL, "internal error; see the router's log"))
        head = shell(body, response_id)

        def keep(response: dict, turn: Turn) -> None:
            if response["store"]:
                store.put(response, conversation + [assistant_message(turn)])

        try:
            result = await run(core, chat, request, True)
        except RequestError as e:
            return error_response(renamed(e, *chat_names(body)))
        except ClientGone:
            return Response(status_code=499)
        if isinstance(result, dict):
            turn = full_turn(result)
            response = finished(head, full_items(turn), turn)
            keep(response, turn)
            return JSONResponse(response)
        return EventStream(stream_events(result, head, keep), SSE_HEADERS, result.close,
                           None)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(request: Request, response_id: str) -> Response:
        try:
            authorize(request)
            stored = store.get(response_id)
            if stored is None:
                raise RequestError(RESPONSE_NOT_FOUND, f"no stored response {response_id!r} "
                                   "(never stored, or expired)", "response_id")
        except RequestError as e:
            return refuse(e)
        return JSONResponse(stored.response)

    return create
