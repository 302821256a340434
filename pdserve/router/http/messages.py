"""Anthropic's Messages API, an adapter over chat completions: ``POST /v1/messages``
translates its request into a chat body (messages_input.py), runs it through the one
path every generating endpoint takes (``api.run``) and maps the chat answer back: a
message object, or Anthropic's SSE events (``message_start``, ``content_block_start``,
``content_block_delta`` with ``text_delta`` / ``input_json_delta``,
``content_block_stop``, ``message_delta`` with the stop reason and usage,
``message_stop``). ``POST /v1/messages/count_tokens`` renders the same prompt and counts
it. Every error is Anthropic's ``{"type": "error", "error": {"type", "message"}}``."""
from __future__ import annotations

import json
import logging
import uuid

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

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
from pdserve.router.http.choices import prompts
from pdserve.router.http.messages_input import chat_body, chat_names, error_body
from pdserve.router.http.openai_schema import check_model
from pdserve.router.http.tools import prepare_tools
from pdserve.router.http.wait import SSE_HEADERS, EventStream
from pdserve.router.streams import INTERNAL, RequestError

logger = logging.getLogger(__name__)

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def stop(turn: Turn) -> dict:
    """Anthropic's stop_reason and stop_sequence of a turn: one of stop_sequences ended
    it (the chat path's stop_reason names it), else the chat finish reason's match."""
    if turn.finish_reason == "stop" and turn.stop_sequence is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": turn.stop_sequence}
    return {"stop_reason": STOP_REASONS.get(turn.finish_reason, "end_turn"),
            "stop_sequence": None}


def _arguments(call: Call) -> dict:
    """A call's arguments as the ``input`` object (the chat path's are JSON text)."""
    try:
        value = json.loads(call.arguments or "{}")
    except ValueError:
        logger.warning("tool call %s has arguments that are not JSON: %r", call.id,
                       call.arguments[:200])
        return {}
    return value if isinstance(value, dict) else {"value": value}


def message_head(message_id: str, model: str, input_tokens: int) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0}}


def full_message(message_id: str, model: str, turn: Turn) -> dict:
    content = [{"type": "text", "text": turn.text}] if turn.text or not turn.calls else []
    content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": _arguments(c)}
                for c in turn.calls]
    return {**message_head(message_id, model, turn.prompt_tokens), "content": content,
            **stop(turn), "usage": {"input_tokens": turn.prompt_tokens,
                                    "output_tokens": turn.completion_tokens}}


def _event(kind: str, data: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) \
        + b"\n\n"


async def stream_events(stream, head: dict):
    """The SSE body of a streamed message."""
    turn, index, open_kind = Turn(), -1, None   # the open content block's index and type
    yield _event("message_start", {"message": head})
    try:
        async for step in stream_steps(stream.chunks(), turn):
            out = b""
            if step[0] == TEXT and open_kind != TEXT or step[0] == CALL:
                if open_kind is not None:
                    out += _event("content_block_stop", {"index": index})
                index, open_kind = index + 1, step[0]
                block = {"type": "text", "text": ""} if step[0] == TEXT else \
                    {"type": "tool_use", "id": step[1].id, "name": step[1].name, "input": {}}
                out += _event("content_block_start", {"index": index, "content_block": block})
            if step[0] == TEXT:
                delta = {"type": "text_delta", "text": step[1]}
            elif step[0] == ARGS and open_kind == CALL and turn.calls[-1] is step[1]:
                delta = {"type": "input_json_delta", "partial_json": step[2]}
            else:
                delta = None
            if delta is not None:
                out += _event("content_block_delta", {"index": index, "delta": delta})
            if out:
                yield out
    except Exception as e:  # ChatFailed: the chat stream's error; else a bug, logged
        if not isinstance(e, ChatFailed):
            logger.exception("message %s failed while streaming", head["id"])
        err = e.error if isinstance(e, ChatFailed) else RequestError(
            INTERNAL, "internal error while streaming; see the router's log")
        yield _event("error", {"error": error_body(err)["error"]})
        return
    out = b""
    if open_kind is None:  # nothing was written: still one (empty) text block
        index, open_kind = 0, TEXT
        out += _event("content_block_start", {"index": 0, "content_block": {
            "type": "text", "text": ""}})
    out += _event("content_block_stop", {"index": index})
    out += _event("message_delta", {
        "delta": stop(turn),
        "usage": {"input_tokens": turn.prompt_tokens or head["usage"]["input_tokens"],
                  "output_tokens": turn.completion_tokens}})
    yield out + _event("message_stop", {})


def add_messages_routes(app: FastAPI, core, authorize, read_json, run, failure):
    """POST /v1/messages and /v1/messages/count_tokens on ``app``; returns the
    /v1/messages handler (api.HotRoutes serves it directly). ``run`` is api.run;
    ``failure`` answers a RequestError in Anthropic's shape (api.error_response)."""
    def refuse(err: RequestError) -> Response:
        core.refused(err)
        return failure(err)

    async def read(request: Request) -> dict:
        authorize(request)
        return await read_json(request)

    @app.post("/v1/messages")
    async def create(request: Request) -> Response:
        message_id = f"msg_{uuid.uuid4().hex}"
        try:
            body = await read(request)
            chat = chat_body(body, message_id)
        except RequestError as e:
            return refuse(e)
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception:
            logger.exception("message %s failed before it was submitted", message_id)
            return refuse(RequestError(INTERNAL, "internal error; see the router's log"))
        try:
            result = await run(core, chat, request, True)
        except RequestError as e:
            return failure(renamed(e, *chat_names(body)))
        except ClientGone:
            return Response(status_code=499)
        if isinstance(result, dict):
            return JSONResponse(full_message(message_id, chat["model"], full_turn(result)))
        head = message_head(message_id, chat["model"], result.answer.num_prompt)
        return EventStream(stream_events(result, head), SSE_HEADERS, result.close, None)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        try:
            body = await read(request)
            chat = chat_body(body, "count_tokens", count_only=True)
            try:
                check_model(chat, core.model_name)
                plan = await prepare_tools(chat, core)  # the tools are rendered in the prompt
                ((_, ids),) = await prompts(core, chat, True, plan)
            except RequestError as e:  # the chat path's: named in this API's fields
                raise renamed(e, *chat_names(body)) from None
        except RequestError as e:
            return refuse(e)
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception:
            logger.exception("count_tokens failed")
            return refuse(RequestError(INTERNAL, "internal error; see the router's log"))
        return JSONResponse({"input_tokens": len(ids)})

    return create
