"""OpenAI-compatible HTTP API, served by uvicorn in the router's own asyncio loop.

A handler reads and checks the body at the edge (a 4xx naming the field and
what is allowed otherwise), tokenizes, calls ``core.submit`` (which never
waits on a socket) and turns the returned ``RequestStream`` into one JSON
body or an SSE stream. Every wait on a stream is raced against the client
going away, so a dropped connection cancels its request on the nodes. What
is supported and what is refused: docs/http-api.md.
"""
from __future__ import annotations

import hmac
import json
import logging
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pdserve.common.errors import REQUEST_TOO_LARGE, UNAUTHORIZED
from pdserve.common.logprobs import empty, join
from pdserve.common.metrics import metrics_endpoint
from pdserve.router.http.choices import (
    Choice,
    Choices,
    TokenTexts,
    choice_logprobs,
    prompts,
    submit_choices,
)
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
from pdserve.router.http.structured import vet_guide
from pdserve.router.http.tokens import add_token_routes
from pdserve.router.http.tool_parsers import finish_reason
from pdserve.router.http.tools import prepare_tools
from pdserve.router.http.wait import ClientWatch, EventStream
from pdserve.router.streams import (
    INTERNAL,
    RequestError,
    StreamEvent,
)

logger = logging.getLogger(__name__)

# -- serving ------------------------------------------------------------------------------
def error_response(err: RequestError) -> JSONResponse:
    status = err.http_status
    if status >= 500:
        logger.error("request failed (%s): %s", err.code, err.message)
    else:
        logger.warning("request refused (%s): %s", err.code, err.message)
    # Overloaded, or no node to serve: worth trying again shortly (RFC 9110 Retry-After).
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return JSONResponse(error_body(err), status_code=status, headers=headers)


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


def _ended_early() -> RequestError:
    return RequestError(INTERNAL, "the request's stream ended without a final event")


@dataclass
class Answer:
    """What shapes the response of one request: its reply head, options and counts."""
    reply: Reply
    opts: ChoiceOptions
    texts: TokenTexts
    num_prompt: int           # prompt tokens, counted once per prompt (not per choice)

    def logprobs(self, choice: Choice, token_ids: list[int], lp, offset: int,
                 with_prompt: bool) -> dict | None:
        if self.opts.logprobs is None:
            return None
        if self.opts.echo_only:
            token_ids, lp = [], empty()
        return choice_logprobs(self.reply.chat, self.texts, choice, self.opts.echo, token_ids,
                               lp, offset, with_prompt)


async def collect(answer: Answer, choices: Choices, watch: ClientWatch) -> Response:
    """A non-streaming response: every event of every choice gathered into one body."""
    while not choices.done:
        item = await watch.next(choices)
        if item is None:
            if watch.gone:  # nobody will read this
                return Response(status_code=499)
            return error_response(_ended_early())
        choice, event = item
        if event.error is not None:
            return error_response(event.error)
        choice.add(event)
    bodies, opts = [], answer.opts
    for c in choices.choices:
        text, calls = "" if opts.echo_only else "".join(c.parts), None
        if c.tools is not None:
            text, calls = c.tools.feed(text, final=True)[0], c.tools.calls
        lp = answer.logprobs(c, c.token_ids, join(c.logprobs), 0, with_prompt=True)
        bodies.append(answer.reply.choice(c.index, c.prompt_text + text, finish_reason(
            c.finish_reason, c.tools), lp, calls))
    completion = 0 if opts.echo_only else choices.completion_tokens()
    return JSONResponse(answer.reply.full(bodies, answer.num_prompt, completion))


def _stream_chunks(answer: Answer, choice: Choice, event: StreamEvent,
                   progress: dict) -> list[dict]:
    """The chunks of one event (its finish reason aside): its text, then its tool-call
    deltas (tool_parsers.ToolStream holds back what may open a call)."""
    opts, echoing = answer.opts, not choice.num_chars and choice.prompt_text
    ids, text = ([], "") if opts.echo_only else (event.token_ids, event.text)
    lp = answer.logprobs(choice, ids, event.logprobs, choice.num_chars, bool(echoing))
    if echoing:
        text = choice.prompt_text + text
    choice.num_chars += len(text)
    out, calls = [], None
    if choice.tools is not None:
        text, calls = choice.tools.feed(text, final=event.finish_reason is not None)
    if text or (lp and (ids or echoing)):
        out.append(answer.reply.chunk(text, index=choice.index, logprobs=lp,
                                      progress=progress))
    # One entry a chunk, as OpenAI streams them: a call's head, then its argument pieces.
    out += [answer.reply.chunk(index=choice.index, progress=progress, tool_calls=[entry])
            for entry in calls or ()]
    return out


async def sse_events(answer: Answer, choices: Choices, watch: ClientWatch, first):
    """The SSE body, one write per turn: the chunks of each event taken (its text, finish,
    usage, [DONE]) leave together. ``first`` (choice, event) is known not to be an error."""
    item, reply = first, answer.reply
    out: list[bytes] = []
    try:
        if reply.chat:
            out += [sse(reply.chunk(role=True, index=c.index,
                                    progress=usage(answer.num_prompt, 0)))
                    for c in choices.choices]
        while True:
            if item is None:
                if not watch.gone:
                    out += [sse(error_body(_ended_early())), SSE_DONE]
                    yield b"".join(out)
                return
            if _event_chunks(answer, choices, item, out):
                break
            yield b"".join(out)
            out = []
            item = await watch.next(choices)
        out.append(SSE_DONE)
        yield b"".join(out)
    except Exception:
        logger.exception("request %s failed while streaming", choices.request_id)
        yield sse(error_body(RequestError(INTERNAL, "internal error while streaming; see the "
                                                    "router's log"))) + SSE_DONE
    finally:
        watch.close(choices)


def _event_chunks(answer: Answer, choices: Choices, item, out: list[bytes]) -> bool:
    """Appends the SSE chunks of one (choice, event) to ``out``; True when the stream ends
    (failed, or every choice finished)."""
    choice, event = item
    reply = answer.reply
    choice.add(event)
    progress = usage(answer.num_prompt, choices.completion_tokens())
    # an event may carry the last tokens and the end together
    out += [sse(chunk) for chunk in _stream_chunks(answer, choice, event, progress)]
    if event.error is not None:
        logger.warning("request %s failed mid-stream (%s): %s", choices.request_id,
                       event.error.code, event.error.message)
        out.append(sse(error_body(event.error)))
        return True
    if event.finish_reason is not None:
        out.append(sse(reply.chunk(finish_reason=finish_reason(choice.finish_reason,
                                                               choice.tools),
                                   index=choice.index, progress=progress)))
    if choices.done:
        if reply.include_usage:
            completion = 0 if answer.opts.echo_only else choices.completion_tokens()
            out.append(sse(reply.usage_chunk(answer.num_prompt, completion)))
        return True
    return False


def make_authorize(api_key: str | None):
    """A check of ``Authorization: Bearer <key>`` (none when ``api_key`` is None)."""
    def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise RequestError(UNAUTHORIZED, "a valid API key is required: send "
                               "'Authorization: Bearer <key>'")
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
        core.refused(RequestError(code, str(exc.detail)))
        body = {"error": {"message": f"{request.method} {request.url.path}: {exc.detail}",
                          "type": "invalid_request_error", "param": None, "code": code}}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def serve(core, authorize, request: Request, chat: bool) -> Response:
    """One completions (``chat`` False) or chat completions request, from body to answer."""
    try:
        authorize(request)
        body = await read_json(request)
        model = check_model(body, core.model_name)
        refuse_unsupported(body, chat)
        plan = await prepare_tools(body, core) if chat else None
        await vet_guide(body, core.guides)
        stream_on, include_usage = stream_options(body)
        opts = choice_options(body, chat)
        prompt_list = await prompts(core, body, chat, plan)
        choices = submit_choices(core, body, chat, opts, prompt_list, plan)
    except RequestError as e:
        return refuse(core, e)
    except ClientDisconnect:
        return Response(status_code=499)
    except Exception:
        logger.exception("request failed before it was submitted")
        return refuse(core, RequestError(INTERNAL, "internal error; see the router's log"))

    reply = Reply(chat, ("chatcmpl-" if chat else "cmpl-") + choices.request_id,
                  int(choices.choices[0].stream.created), model, include_usage,
                  continuous_usage_stats(body))
    answer = Answer(reply, opts, TokenTexts(core.tokenizer),
                    sum(len(ids) for _, ids in prompt_list))
    watch, handed_over = ClientWatch(request), False
    try:
        if not stream_on:
            return await collect(answer, choices, watch)
        # Wait for the first event so that an early failure gets its own HTTP status.
        first = await watch.next(choices)
        if first is None:
            return Response(status_code=499) if watch.gone else error_response(_ended_early())
        if first[1].error is not None:
            return error_response(first[1].error)
        handed_over = True
        return EventStream(sse_events(answer, choices, watch, first),
                           {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                           lambda: watch.close(choices), SSE_DONE)
    except Exception:
        logger.exception("request %s failed", choices.request_id)
        return error_response(RequestError(INTERNAL, "internal error; see the router's log"))
    finally:
        if not handed_over:
            watch.close(choices)


class HotRoutes:
    """The ASGI app uvicorn serves: POST /v1/completions and /v1/chat/completions go
    straight to ``serve``, every other request to the FastAPI app. FastAPI's layers
    (middleware, routing, dependencies, telemetry, a wrapper around every ``send``) cost
    about an eighth of the router's CPU per streamed request (an A/B in
    benchmarks/RESULTS.md) and do nothing for these two: ``serve`` reads and checks the
    body itself and answers every failure with its own OpenAI error. ``fastapi``: the app
    behind, where other routes are added (these two are there too, so that another
    method gets its 405)."""

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

    add_token_routes(app, core, authorize, read_json, lambda e: refuse(core, e))

    @app.get("/health")
    async def health() -> Response:
        ok, reason = core.health()
        # Turns of the router's loops: a monitor (or test) sees them move.
        loops = dict(getattr(core, "loop_ticks", {}))
        if ok:
            return JSONResponse({"status": "ok", "loops": loops})
        return JSONResponse({"status": "unavailable", "reason": reason, "loops": loops},
                            status_code=503)

    app.add_route("/metrics", metrics_endpoint(core.metrics.registry), methods=["GET"])
    return HotRoutes(app, {"/v1/completions": completions,
                           "/v1/chat/completions": chat_completions})
