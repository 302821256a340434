"""OpenAI-compatible HTTP API, served by uvicorn in the router's own asyncio loop.

A handler reads and checks the body at the edge (a 4xx naming the field and
what is allowed otherwise), tokenizes, calls ``core.submit`` (which never
waits on a socket) and turns the returned ``RequestStream`` into one JSON
body or an SSE stream. Every wait on a stream is raced against the client
going away, so a dropped connection cancels its request on the nodes. What
is supported and what is refused: docs/http-api.md.
"""
from __future__ import annotations

import functools
import hmac
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pdserve.common.errors import REQUEST_TOO_LARGE, UNAUTHORIZED
from pdserve.common.metrics_http import metrics_endpoint
from pdserve.router.http.answers import Answer, ChunkStream, ClientGone, collect, ended_early
from pdserve.router.http.choices import TokenTexts, prompts, submit_choices
from pdserve.router.http.messages import add_messages_routes
from pdserve.router.http.messages_input import error_body as anthropic_error
from pdserve.router.http.openai_schema import (  # noqa: F401 (re-exported: the app's API)
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    MAX_BODY_BYTES,
    SSE_DONE,
    ChoiceOptions,
    Reply,
    bad,
    chat_messages,
    chat_prompt_ids,
    check_model,
    choice_options,
    completion_prompt,
    completion_prompt_ids,
    completion_prompts,
    continuous_usage_stats,
    encode_text,
    error_body,
    json_depth_problem,
    refuse_unsupported,
    sampling_params,
    sse,
    stream_options,
    usage,
)
from pdserve.router.http.responses import add_responses_routes
from pdserve.router.http.structured import vet_guide
from pdserve.router.http.tokens import add_token_routes
from pdserve.router.http.tools import prepare_tools
from pdserve.router.http.wait import SSE_HEADERS, ClientWatch, EventStream
from pdserve.router.streams import INTERNAL, STREAM_NOT_FOUND, RequestError

logger = logging.getLogger(__name__)

# -- serving ------------------------------------------------------------------------------
def error_response(err: RequestError, body=error_body) -> JSONResponse:
    """``err`` logged and answered; ``body`` shapes it (OpenAI's, or Anthropic's)."""
    status = err.http_status
    if status >= 500:
        logger.error("request failed (%s): %s", err.code, err.message)
    else:
        logger.warning("request refused (%s): %s", err.code, err.message)
    # Overloaded, or no node to serve: worth trying again shortly (RFC 9110 Retry-After).
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return JSONResponse(body(err), status_code=status, headers=headers)


def refuse(core, err: RequestError) -> JSONResponse:
    """How every route answers a request it refuses: counted once in
    pdserve_request_errors_total (``core.refused``), then the OpenAI error body."""
    core.refused(err)
    return error_response(err)


async def read_json(request: Request) -> dict:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise RequestError(REQUEST_TOO_LARGE, f"the request body has {length} bytes; at most "
                           f"{MAX_BODY_BYTES} are accepted")
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_BODY_BYTES:
            raise RequestError(REQUEST_TOO_LARGE, f"the request body is over "
                               f"{MAX_BODY_BYTES} bytes, the most accepted")
    try:
        body = json.loads(bytes(data))
    except RecursionError:  # hostile nesting ([[[[...): valid JSON, too deep to read
        raise bad("the request body nests arrays/objects too deep to read") from None
    except ValueError as e:
        raise bad(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    problem = json_depth_problem(body)
    if problem:
        raise bad(problem)
    return body


async def sse_events(stream: ChunkStream):
    """The SSE body, one write per turn: the chunks of each event taken (its text, finish,
    usage, [DONE]) leave together."""
    async for turn, ended in stream.turns():
        yield b"".join(map(sse, turn)) + (SSE_DONE if ended else b"")


def make_authorize(api_key: str | None):
    """A check of ``Authorization: Bearer <key>``, or ``x-api-key: <key>`` (what the
    Anthropic clients send); none when ``api_key`` is None."""
    def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            return
        if hmac.compare_digest(request.headers.get("x-api-key", "").encode(),
                               api_key.encode()):
            return
        raise RequestError(UNAUTHORIZED, "a valid API key is required: send "
                           "'Authorization: Bearer <key>' (or 'x-api-key: <key>')")
    return authorize


def add_error_handlers(app: FastAPI, core) -> None:
    """FastAPI's own refusals (validation, 404, 405) in the OpenAI error body, counted."""
    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        msgs = [f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}"
                for e in exc.errors()]
        return refuse(core, bad("; ".join(msgs) or "invalid request"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        err = RequestError(code, f"{request.method} {request.url.path}: {exc.detail}")
        core.refused(err)
        if request.url.path.startswith("/v1/messages"):  # Anthropic's clients read its shape
            body = anthropic_error(err, exc.status_code)
        else:
            body = {"error": {"message": err.message, "type": "invalid_request_error",
                              "param": None, "code": code}}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def run(core, body: dict, request: Request, chat: bool) -> dict | ChunkStream:
    """One completions (``chat`` False) or chat completions request from its body to its
    answer: the full response body, or with ``stream`` a ChunkStream (its first event
    waited for, so that an early failure gets its own HTTP status). The one path every
    generating endpoint takes (/v1/responses and /v1/messages translate into a chat body).
    Raises RequestError (counted once in pdserve_request_errors_total) or ClientGone."""
    try:
        model = check_model(body, core.model_name)
        refuse_unsupported(body, chat)
        plan = await prepare_tools(body, core) if chat else None
        await vet_guide(body, core.guides)
        stream_on, include_usage = stream_options(body)
        opts = choice_options(body, chat)
        prompt_list = await prompts(core, body, chat, plan)
        choices = submit_choices(core, body, chat, opts, prompt_list, plan)
    except RequestError as e:
        core.refused(e)
        raise
    except Exception:
        logger.exception("request failed before it was submitted")
        err = RequestError(INTERNAL, "internal error; see the router's log")
        core.refused(err)
        raise err from None

    reply = Reply(chat, ("chatcmpl-" if chat else "cmpl-") + choices.request_id,
                  int(choices.choices[0].stream.created), model, include_usage,
                  continuous_usage_stats(body))
    answer = Answer(reply, opts, TokenTexts(core.tokenizer),
                    sum(len(ids) for _, ids in prompt_list))
    watch, handed_over = ClientWatch(request), False
    try:
        if not stream_on:
            return await collect(answer, choices, watch)
        first = await watch.next(choices)
        if first is None:
            raise ClientGone() if watch.gone else ended_early()
        if first[1].error is not None:
            raise first[1].error
        handed_over = True
        return ChunkStream(answer, choices, watch, first)
    except (RequestError, ClientGone):
        raise
    except Exception:
        logger.exception("request %s failed", choices.request_id)
        raise RequestError(INTERNAL, "internal error; see the router's log") from None
    finally:
        if not handed_over:
            watch.close(choices)


async def serve(core, authorize, request: Request, chat: bool) -> Response:
    """One completions (``chat`` False) or chat completions request, from HTTP to HTTP."""
    try:
        authorize(request)
        body = await read_json(request)
    except RequestError as e:
        return refuse(core, e)
    except ClientDisconnect:
        return Response(status_code=499)
    except Exception:
        logger.exception("request failed before it was read")
        return refuse(core, RequestError(INTERNAL, "internal error; see the router's log"))
    try:
        result = await run(core, body, request, chat)
    except RequestError as e:
        return error_response(e)
    except ClientGone:
        return Response(status_code=499)
    if isinstance(result, dict):
        return JSONResponse(result)
    return EventStream(sse_events(result), SSE_HEADERS, result.close, SSE_DONE)


class HotRoutes:
    """The ASGI app uvicorn serves: POST /v1/completions, /v1/chat/completions,
    /v1/responses and /v1/messages go straight to their handler, every other request to
    the FastAPI app. FastAPI's layers (middleware, routing, dependencies, telemetry, a
    wrapper around every ``send``) cost about an eighth of the router's CPU per streamed
    request (an A/B in benchmarks/RESULTS.md) and do nothing for these: each handler
    reads and checks the body itself and answers every failure with its own API's error.
    ``fastapi``: the app behind, where other routes are added (these are there too, so
    that another method gets its 405)."""

    def __init__(self, fastapi: FastAPI, routes: dict):
        self.fastapi = fastapi
        self.routes = routes  # path -> async handler(Request) -> Response

    async def __call__(self, scope, receive, send) -> None:
        handler = self.routes.get(scope["path"]) if scope["type"] == "http" and \
            scope["method"] == "POST" else None
        if handler is None:
            return await self.fastapi(scope, receive, send)
        try:
            response = await handler(Request(scope, receive))
        except Exception:  # serve answers its own failures: this is a bug
            logger.exception("%s failed", scope["path"])
            response = error_response(RequestError(INTERNAL, "internal error; see the "
                                                             "router's log"))
        try:
            await response(scope, receive, send)
        except ClientDisconnect:  # gone mid-stream: on_close has cancelled the request
            pass


def build_app(core, api_key: str | None = None) -> HotRoutes:
    """The app over ``core`` (see router/core.py), /metrics included. ``api_key``: require
    ``Authorization: Bearer <key>`` on /v1/*."""
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    started = int(time.time())
    authorize = make_authorize(api_key)
    add_error_handlers(app, core)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(core, authorize, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(core, authorize, request, chat=True)

    def model_card() -> dict:
        return {"id": core.model_name, "object": "model", "created": started,
                "owned_by": "pdserve", "max_model_len": core.max_model_len}

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            authorize(request)
        except RequestError as e:
            return refuse(core, e)
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> Response:
        try:
            authorize(request)
            check_model({"model": model}, core.model_name)
        except RequestError as e:
            return refuse(core, e)
        return JSONResponse(model_card())

    @app.get("/v1/streams/{stream_id}")
    async def stream_resume(request: Request, stream_id: str) -> Response:
        """Where an HTTP client whose router died asks to go on (docs/http-api.md, "When a
        router dies"): HTTP streams are not kept for a resume yet, and this says so."""
        try:
            authorize(request)
        except RequestError as e:
            return refuse(core, e)
        return refuse(core, RequestError(STREAM_NOT_FOUND, (
            f"stream {stream_id[:100]!r} cannot be resumed: HTTP streams are not kept for a "
            "resume; send the request again (a greedy or seeded request gives the same "
            "tokens), or use the queue ingress, whose streams resume on another router "
            "(docs/queue-protocol.md)")))

    add_token_routes(app, core, authorize, read_json, lambda e: refuse(core, e))
    responses = add_responses_routes(app, core, authorize, read_json, run, error_response)
    messages = add_messages_routes(app, core, authorize, read_json, run,
                                   functools.partial(error_response, body=anthropic_error))

    @app.get("/health")
    async def health() -> Response:
        ok, reason = core.ready()
        # Turns of the router's loops: a monitor (or test) sees them move.
        loops = dict(getattr(core, "loop_ticks", {}))
        if ok:  # (the reason says what serves, and whether the prefix index is degraded)
            return JSONResponse({"status": "ok", "reason": reason, "loops": loops})
        return JSONResponse({"status": "unavailable", "reason": reason, "loops": loops},
                            status_code=503)

    app.add_route("/metrics", metrics_endpoint(core.metrics.registry), methods=["GET"])
    return HotRoutes(app, {"/v1/completions": completions,
                           "/v1/chat/completions": chat_completions,
                           "/v1/responses": responses, "/v1/messages": messages})
