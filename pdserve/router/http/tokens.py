"""vLLM's tokenizer endpoints and /version, beside the OpenAI API.

- ``POST /tokenize``: ``{"prompt": text or token ids}`` (``add_special_tokens``, default
  true) or ``{"messages": [...]}`` (the chat template with the generation prompt, as a
  chat request is tokenized, with its ``tools`` if given) -> ``{"count", "max_model_len",
  "tokens", "token_strs"}``;
  ``token_strs`` with ``return_token_strs: true``, else null.
- ``POST /detokenize``: ``{"tokens": [ids]}`` -> ``{"prompt": text}``.
- ``GET /tokenizer_info``: the tokenizer's config as vLLM serves it (tokenizer_config.json
  without file paths: ``tokenizer_class``, the special tokens as text, ``chat_template``,
  ``model_max_length``), what lm-eval's ``tokenizer_backend=remote`` reads.
- ``GET /version``: ``{"version": pdserve's version}``.

The same edge as the generation endpoints: API key, body size and depth, model name,
prompt size, ids inside the vocabulary; tokenizing runs in the router's tokenizer pool.
Fields these endpoints do not know are refused by name, never ignored.
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdserve import __version__
from pdserve.router.http.openai_schema import (
    bad,
    chat_messages,
    chat_prompt_ids,
    check_model,
    completion_prompt,
    encode_text,
    get_field,
)
from pdserve.router.http.tools import tool_plan
from pdserve.router.limits import check_prompt_bytes
from pdserve.router.streams import RequestError

TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "return_token_strs",
                   "add_generation_prompt", "tools"}
DETOKENIZE_FIELDS = {"model", "tokens"}


def _only(body: dict, known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad(f"unsupported field(s) {unknown}; this endpoint takes {sorted(known)}",
                  unknown[0])


def _token_ids(body: dict, vocab_size: int, limit: int) -> list[int]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not tokens:
        raise bad("'tokens' must be a non-empty list of token ids", "tokens")
    if len(tokens) > limit:
        raise bad(f"'tokens' has {len(tokens)} ids; at most {limit} (the model's context)",
                  "tokens")
    wrong = [t for t in tokens if isinstance(t, bool) or not isinstance(t, int)
             or not 0 <= t < vocab_size]
    if wrong:
        raise bad(f"'tokens' holds ids outside [0, {vocab_size}): {wrong[:5]}", "tokens")
    return tokens


async def _tokenize(core, body: dict) -> dict:
    _only(body, TOKENIZE_FIELDS)
    if ("messages" in body) == ("prompt" in body):
        raise bad("give exactly one of 'prompt' and 'messages'", "prompt")
    if get_field(body, "add_generation_prompt", "a boolean", True) is not True:
        raise bad("add_generation_prompt=false is not supported", "add_generation_prompt")
    special = get_field(body, "add_special_tokens", "a boolean", True)
    if "messages" in body:
        messages = chat_messages(body["messages"])
        check_prompt_bytes("".join(m["content"] for m in messages), core.config, "messages")
        plan = tool_plan({"tools": body.get("tools")}, core.config.tool_call_parser,
                         core.tokenizer.chat_template) if body.get("tools") else None
        ids = await core.tokenizing.run(chat_prompt_ids, core.tokenizer, messages,
                                        plan and plan.tools, plan and plan.family)
    else:
        prompt = completion_prompt(body["prompt"])
        if isinstance(prompt, list):
            ids = _token_ids({"tokens": prompt}, core.model_config.vocab_size,
                             core.max_model_len)
        else:
            check_prompt_bytes(prompt, core.config)
            ids = await core.tokenizing.run(encode_text, core.tokenizer, prompt, special)
    strs = None
    if get_field(body, "return_token_strs", "a boolean", False):
        strs = [core.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    return {"count": len(ids), "max_model_len": core.max_model_len, "tokens": ids,
            "token_strs": strs}


async def _detokenize(core, body: dict) -> dict:
    _only(body, DETOKENIZE_FIELDS)
    ids = _token_ids(body, core.model_config.vocab_size, core.max_model_len)
    return {"prompt": await core.tokenizing.run(core.tokenizer.decode, ids)}


def add_token_routes(app: FastAPI, core, authorize, read_json, error_response) -> None:
    """Adds the routes; ``authorize``, ``read_json`` and ``error_response`` are the OpenAI
    API's own, so the edge is the same."""

    async def handle(request: Request, answer) -> Response:
        try:
            authorize(request)
            body = await read_json(request)
            if "model" in body:
                check_model(body, core.model_name)
            return JSONResponse(await answer(core, body))
        except RequestError as e:
            return error_response(e)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await handle(request, _tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await handle(request, _detokenize)

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        try:
            authorize(request)
        except RequestError as e:
            return error_response(e)
        info = core.tokenizer.hf_config()
        info.setdefault("model_max_length", core.max_model_len)
        return JSONResponse(info)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})
