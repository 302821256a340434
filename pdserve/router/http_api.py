"""OpenAI-compatible HTTP API, served by uvicorn in the router's own asyncio loop.

A handler reads and checks the body at the edge (a 4xx naming the field and
what is allowed otherwise), tokenizes, calls ``core.submit`` (which never
waits on a socket) and turns the returned ``RequestStream`` into one JSON
body or an SSE stream. Every wait on a stream is raced against the client
going away, so a dropped connection cancels its request on the nodes. What
is supported and what is refused: docs/http-api.md.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.streams import (
    BAD_REQUEST,
    INTERNAL,
    NOT_FOUND,
    GenerationRequest,
    RequestError,
    RequestStream,
    StreamEvent,
)

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16      # OpenAI's default for /v1/completions
TOO_LARGE, UNAUTHORIZED = "request_too_large", "invalid_api_key"  # HTTP-layer codes
_EXTRA_STATUS = {TOO_LARGE: 413, UNAUTHORIZED: 401}

# Fields we do not implement -> the values that mean "not used". Anything else is
# refused with a 400 rather than silently ignored. None (or absent) is always fine.
_UNSUPPORTED_COMMON = {
    "n": (1,), "best_of": (1,), "logit_bias": ({},), "presence_penalty": (0,),
    "frequency_penalty": (0,), "repetition_penalty": (1,), "min_p": (0,), "min_tokens": (0,),
    "use_beam_search": (False,),
}
_UNSUPPORTED_COMPLETIONS = {"echo": (False,), "logprobs": (), "suffix": ("",)}
_UNSUPPORTED_CHAT = {
    "logprobs": (False,), "top_logprobs": (0,), "tools": ([],), "functions": ([],),
    "tool_choice": ("none", "auto"), "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},), "audio": (), "prediction": (),
    "modalities": (["text"],),
}
CHAT_ROLES = ("system", "developer", "user", "assistant")
_KINDS = {
    "an integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "a number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "a boolean": lambda v: isinstance(v, bool),
    "an object": lambda v: isinstance(v, dict),
}


# -- checking the request body (pure helpers) -------------------------------------------
def bad(message: str, param: str | None = None) -> RequestError:
    return RequestError(BAD_REQUEST, message, param)


def _show(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def get_field(body: dict, name: str, kind: str, default=None):
    """``body[name]`` checked against ``kind`` (a key of _KINDS); absent or null -> default."""
    value = body.get(name)
    if value is None:
        return default
    if not _KINDS[kind](value):
        raise bad(f"{name} must be {kind}, got {_show(value)}", name)
    return value


def check_model(body: dict, served: str) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad(f"model is required and must be a string: this server serves {served!r}",
                  "model")
    if model != served:
        raise RequestError(NOT_FOUND, f"model {model!r} is not served here; this server serves "
                           f"{served!r}", "model")
    return model


def refuse_unsupported(body: dict, chat: bool) -> None:
    table = {**_UNSUPPORTED_COMMON, **(_UNSUPPORTED_CHAT if chat else _UNSUPPORTED_COMPLETIONS)}
    for name, fine in table.items():
        value = body.get(name)
        if value is not None and not any(value == f and type(value) is not bool
                                         or value is f for f in fine):
            allowed = " or ".join(_show(f) for f in fine)
            raise bad(f"{name}={_show(value)} is not supported by this server; leave it out"
                      + (f" or set it to {allowed}" if allowed else ""), name)


def stream_options(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = get_field(body, "stream", "a boolean", False)
    options = get_field(body, "stream_options", "an object")
    if options is not None and not stream:
        raise bad("stream_options is only allowed when stream is true", "stream_options")
    include_usage = get_field(options or {}, "include_usage", "a boolean", False)
    return stream, include_usage


def sampling_params(body: dict, default_max_tokens: int,
                    max_tokens_names: tuple[str, ...] = ("max_tokens",)) -> SamplingParams:
    """SamplingParams from the body; the first of ``max_tokens_names`` that is set wins."""
    max_tokens = default_max_tokens
    for name in reversed(max_tokens_names):
        value = get_field(body, name, "an integer")
        if value is not None:
            if value < 1:
                raise bad(f"{name} must be >= 1, got {value}", name)
            max_tokens = value
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad(f"stop must be a string or an array of strings, got {_show(stop)}", "stop")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and not (isinstance(stop_ids, list)
                                     and all(_KINDS["an integer"](t) for t in stop_ids)):
        raise bad(f"stop_token_ids must be an array of integers, got {_show(stop_ids)}",
                  "stop_token_ids")
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=get_field(body, "temperature", "a number", 1.0),
            top_p=get_field(body, "top_p", "a number", 1.0),
            top_k=get_field(body, "top_k", "an integer", 0),
            seed=get_field(body, "seed", "an integer"), stop=stop or [],
            stop_token_ids=stop_ids or [], ignore_eos=get_field(body, "ignore_eos", "a boolean",
                                                                False))
    except ValueError as e:  # SamplingParams says "name=value is invalid: allowed"
        raise bad(str(e), str(e).split("=", 1)[0]) from None


def completion_prompt_ids(tokenizer, prompt) -> list[int]:
    """A string (encoded with the tokenizer's special tokens, as the offline LLM does), a list
    of token ids, or a list holding one of those. Several prompts are refused."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and all(_KINDS["an integer"](t) for t in prompt):
        return list(prompt)
    if prompt is None:
        raise bad("prompt is required", "prompt")
    if isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
        raise bad(f"only one prompt per request is supported, got {len(prompt)}: send one "
                  "request per prompt", "prompt")
    raise bad("prompt must be a string, an array of token ids, or an array holding one of "
              f"those; got {_show(prompt)}", "prompt")


def chat_messages(messages) -> list[dict]:
    """The messages as [{role, content: str}]; text parts are joined with newlines."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages is required: a non-empty array of {role, content} objects",
                  "messages")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad(f"{where} must be an object with role and content", where)
        role, content = msg.get("role"), msg.get("content")
        if role not in CHAT_ROLES:
            raise bad(f"{where}.role must be one of {', '.join(CHAT_ROLES)}; got {_show(role)}",
                      f"{where}.role")
        if msg.get("tool_calls"):
            raise bad(f"{where}.tool_calls is not supported: this server has no tool calling",
                      f"{where}.tool_calls")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise bad(f"{where}.content[{j}] must be {{\"type\": \"text\", \"text\": "
                              f"string}}: only text content is supported; got {_show(part)}",
                              f"{where}.content")
            content = "\n".join(part["text"] for part in content)
        if not isinstance(content, str):
            raise bad(f"{where}.content must be a string or an array of text parts; got "
                      f"{_show(content)}", f"{where}.content")
        out.append({"role": role, "content": content})
    return out


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Renders the chat template and encodes it without adding special tokens, as
    transformers' apply_chat_template(tokenize=True) does: the template itself writes
    any BOS it wants (the bundled one writes none)."""
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except (ValueError, jinja2.TemplateError) as e:
        raise bad(f"cannot render the chat template for these messages: {e}",
                  "messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


# -- wire shapes (pure) -------------------------------------------------------------------
def error_body(err: RequestError) -> dict:
    status = status_of(err)
    kind = {401: "authentication_error", 429: "rate_limit_error"}.get(status) or (
        "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": err.message, "type": kind, "param": err.param,
                      "code": err.code}}


def status_of(err: RequestError) -> int:
    return _EXTRA_STATUS.get(err.code) or err.http_status


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


@dataclass
class Reply:
    """The response objects of one request, chat or text completion."""
    chat: bool
    id: str
    created: int
    model: str
    include_usage: bool = False

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, text: str = "", finish_reason: str | None = None,
              role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text} if role else \
                ({"content": text} if text or finish_reason is None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None,
                      "finish_reason": finish_reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            out = {**self._head("text_completion"), "choices": [
                {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(prompt_tokens,
                                                                  completion_tokens)}

    def full(self, text: str, finish_reason: str, prompt_tokens: int,
             completion_tokens: int) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish_reason}
            head = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            head = self._head("text_completion")
        return {**head, "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}


# -- serving ------------------------------------------------------------------------------
def error_response(err: RequestError) -> JSONResponse:
    status = status_of(err)
    if status >= 500:
        logger.error("request failed (%s): %s", err.code, err.message)
    else:
        logger.warning("request refused (%s): %s", err.code, err.message)
    # Overloaded, or no node to serve: worth trying again shortly (RFC 9110 Retry-After).
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return JSONResponse(error_body(err), status_code=status, headers=headers)


async def read_json(request: Request) -> dict:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise RequestError(TOO_LARGE, f"the request body has {length} bytes; at most "
                           f"{MAX_BODY_BYTES} are accepted")
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_BODY_BYTES:
            raise RequestError(TOO_LARGE, f"the request body is over {MAX_BODY_BYTES} bytes, "
                               "the most accepted")
    try:
        body = json.loads(bytes(data))
    except (ValueError, RecursionError) as e:  # RecursionError: hostile nesting ([[[[...)
        raise bad(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


class ClientWatch:
    """Races waits on a stream against the client's disconnect (an ASGI receive)."""

    def __init__(self, request: Request):
        self._gone = asyncio.ensure_future(self._wait(request.receive))

    @staticmethod
    async def _wait(receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    @property
    def gone(self) -> bool:
        return self._gone.done()

    async def next(self, stream: RequestStream) -> StreamEvent | None:
        """The next event, or None when the client went away or the stream ended."""
        nxt = asyncio.ensure_future(_next_event(stream))
        try:
            await asyncio.wait((nxt, self._gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not nxt.done():
                nxt.cancel()
        return nxt.result() if nxt.done() and not nxt.cancelled() else None

    def close(self, stream: RequestStream) -> None:
        self._gone.cancel()
        stream.cancel()  # a no-op once the stream ended


async def _next_event(stream: RequestStream) -> StreamEvent | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


def _ended_early() -> RequestError:
    return RequestError(INTERNAL, "the request's stream ended without a final event")


async def collect(reply: Reply, stream: RequestStream, watch: ClientWatch,
                  num_prompt: int) -> Response:
    """A non-streaming response: every event gathered into one body."""
    parts, num_tokens = [], 0
    while True:
        event = await watch.next(stream)
        if event is None:
            if watch.gone:  # nobody will read this
                return Response(status_code=499)
            return error_response(_ended_early())
        if event.error is not None:
            return error_response(event.error)
        parts.append(event.text)
        num_tokens += len(event.token_ids)
        if event.finish_reason is not None:
            return JSONResponse(reply.full("".join(parts), event.finish_reason, num_prompt,
                                           event.completion_tokens or num_tokens))


async def sse_events(reply: Reply, stream: RequestStream, watch: ClientWatch,
                     first: StreamEvent, num_prompt: int):
    """The SSE body; ``first`` is already known not to be an error."""
    event, num_tokens = first, 0
    try:
        if reply.chat:
            yield sse(reply.chunk(role=True))
        while True:
            if event is None:
                if not watch.gone:
                    yield sse(error_body(_ended_early()))
                    yield SSE_DONE
                return
            if event.error is not None:
                logger.warning("request %s failed mid-stream (%s): %s", stream.request_id,
                               event.error.code, event.error.message)
                yield sse(error_body(event.error))
                break
            num_tokens += len(event.token_ids)
            if event.text:
                yield sse(reply.chunk(event.text))
            if event.finish_reason is not None:
                yield sse(reply.chunk(finish_reason=event.finish_reason))
                if reply.include_usage:
                    yield sse(reply.usage_chunk(num_prompt,
                                                event.completion_tokens or num_tokens))
                break
            event = await watch.next(stream)
        yield SSE_DONE
    except Exception:
        logger.exception("request %s failed while streaming", stream.request_id)
        yield sse(error_body(RequestError(INTERNAL, "internal error while streaming; see the "
                                                    "router's log")))
        yield SSE_DONE
    finally:
        watch.close(stream)


def build_app(core, api_key: str | None = None) -> FastAPI:
    """The app over ``core`` (see router/core.py). ``api_key``: require
    ``Authorization: Bearer <key>`` on /v1/*."""
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    started = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        msgs = [f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}"
                for e in exc.errors()]
        return error_response(bad("; ".join(msgs) or "invalid request"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        body = {"error": {"message": f"{request.method} {request.url.path}: {exc.detail}",
                          "type": "invalid_request_error", "param": None, "code": code}}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise RequestError(UNAUTHORIZED, "a valid API key is required: send "
                               "'Authorization: Bearer <key>'")

    async def serve(request: Request, chat: bool) -> Response:
        try:
            authorize(request)
            body = await read_json(request)
            model = check_model(body, core.model_name)
            refuse_unsupported(body, chat)
            stream_on, include_usage = stream_options(body)
            if chat:
                ids = chat_prompt_ids(core.tokenizer, chat_messages(body.get("messages")))
                # Default: as many tokens as the context leaves (core.check refuses a full one).
                params = sampling_params(body, max(1, core.max_model_len - len(ids)),
                                         ("max_completion_tokens", "max_tokens"))
            else:
                ids = completion_prompt_ids(core.tokenizer, body.get("prompt"))
                params = sampling_params(body, COMPLETIONS_DEFAULT_MAX_TOKENS)
            req = GenerationRequest(ids, params, request_id=uuid.uuid4().hex)
            stream = core.submit(req)  # runs core.check: context, vocabulary, params
        except RequestError as e:
            return error_response(e)
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception:
            logger.exception("request failed before it was submitted")
            return error_response(RequestError(INTERNAL, "internal error; see the router's log"))

        reply = Reply(chat, ("chatcmpl-" if chat else "cmpl-") + req.request_id,
                      int(stream.created), model, include_usage)
        watch, handed_over = ClientWatch(request), False
        try:
            if not stream_on:
                return await collect(reply, stream, watch, len(ids))
            # Wait for the first event so that an early failure gets its own HTTP status.
            first = await watch.next(stream)
            if first is None:
                return Response(status_code=499) if watch.gone else \
                    error_response(_ended_early())
            if first.error is not None:
                return error_response(first.error)
            handed_over = True
            return StreamingResponse(
                sse_events(reply, stream, watch, first, len(ids)),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                # Runs even when the body was never iterated (client gone before start).
                background=BackgroundTask(watch.close, stream))
        except Exception:
            logger.exception("request %s failed", stream.request_id)
            return error_response(RequestError(INTERNAL, "internal error; see the router's log"))
        finally:
            if not handed_over:
                watch.close(stream)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, chat=True)

    def model_card() -> dict:
        return {"id": core.model_name, "object": "model", "created": started,
                "owned_by": "pdserve", "max_model_len": core.max_model_len}

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            authorize(request)
        except RequestError as e:
            return error_response(e)
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> Response:
        try:
            authorize(request)
            check_model({"model": model}, core.model_name)
        except RequestError as e:
            return error_response(e)
        return JSONResponse(model_card())

    @app.get("/health")
    async def health() -> Response:
        ok, reason = core.health()
        if ok:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

    return app
