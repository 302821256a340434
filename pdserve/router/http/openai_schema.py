"""The OpenAI request and response shapes, as pure functions: reading and checking a body
(a 4xx naming the field and what is allowed otherwise) and building response objects.
What is supported and what is refused: docs/http-api.md."""
from __future__ import annotations

import json
from dataclasses import dataclass

import jinja2
import msgspec
import orjson

from pdserve.common.limits import MAX_LOGPROBS, MAX_SEED
from pdserve.common.sampling import SamplingParams
from pdserve.router.http.structured import logits_processing
from pdserve.router.http.tools import for_template, tool_message
from pdserve.router.streams import BAD_REQUEST, NOT_FOUND, RequestError

MAX_BODY_BYTES = 4 << 20
MAX_JSON_DEPTH = 32                      # nesting of arrays and objects in a request body
COMPLETIONS_DEFAULT_MAX_TOKENS = 16      # OpenAI's default for /v1/completions

# Fields we do not implement -> the values that mean "not used". Anything else is
# refused with a 400 rather than silently ignored. None (or absent) is always fine.
_UNSUPPORTED_COMMON = {
    "best_of": (1,), "min_p": (0,),
    "use_beam_search": (False,),
}
_UNSUPPORTED_COMPLETIONS = {"suffix": ("",)}
_UNSUPPORTED_CHAT = {
    "echo": (False,), "functions": ([],), "function_call": ("none", "auto"),
    "audio": (), "prediction": (),
    "modalities": (["text"],),
}
# vLLM's extensions this server does not implement, refused like the above.
_UNSUPPORTED_VLLM = {
    "length_penalty": (1,), "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (), "allowed_token_ids": (), "bad_words": ([],),
    "logits_processors": (), "priority": (0,), "cache_salt": (), "kv_transfer_params": (),
    "vllm_xargs": (), "prompt_embeds": (), "guided_decoding_backend": (),
    "guided_whitespace_pattern": (), "guided_json_object": (False,), "prompt_logprobs": (),
    "return_tokens_as_token_ids": (False,),
}
_UNSUPPORTED_VLLM_CHAT = {
    "add_generation_prompt": (True,), "continue_final_message": (False,),
    "add_special_tokens": (False,), "chat_template": (), "chat_template_kwargs": ({},),
    "documents": (), "mm_processor_kwargs": (),
    "reasoning_effort": (), "include_reasoning": (True,),
}
_UNSUPPORTED_VLLM_COMPLETIONS = {"add_special_tokens": (True,)}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
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
    if (value := body.get(name)) is None:
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
    table = {**_UNSUPPORTED_COMMON, **(_UNSUPPORTED_CHAT if chat else _UNSUPPORTED_COMPLETIONS),
             **_UNSUPPORTED_VLLM,
             **(_UNSUPPORTED_VLLM_CHAT if chat else _UNSUPPORTED_VLLM_COMPLETIONS)}
    for name, fine in table.items():
        value = body.get(name)
        if value is not None and not any(value == f and type(value) is not bool
                                         or value is f for f in fine):
            allowed = " or ".join(_show(f) for f in fine)
            raise bad(f"{name}={_show(value)} is not supported by this server; leave it out"
                      + (f" or set it to {allowed}" if allowed else ""), name)


def continuous_usage_stats(body: dict) -> bool:
    """stream_options.continuous_usage_stats: usage in every chunk (with include_usage)."""
    options = get_field(body, "stream_options", "an object") or {}
    return bool(get_field(options, "include_usage", "a boolean", False)
                and get_field(options, "continuous_usage_stats", "a boolean", False))


def stream_options(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = get_field(body, "stream", "a boolean", False)
    options = get_field(body, "stream_options", "an object")
    if options is not None and not stream:
        raise bad("stream_options is only allowed when stream is true", "stream_options")
    include_usage = get_field(options or {}, "include_usage", "a boolean", False)
    return stream, include_usage


# The body fields that are SamplingParams' own, under its names: their types, limits and
# defaults are its (a bad value is its ValueError, naming the field and what is allowed).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                   "ignore_eos")


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
    stop = body.get("stop")  # the one field whose HTTP form is not the type's: a string too
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad(f"stop must be a string or an array of strings, got {_show(stop)}", "stop")
    given = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    if stop == "":
        del given["stop"]  # no stop string, as it always read here (and in OpenAI's API)
    try:
        return SamplingParams(max_tokens=max_tokens, **given, **logits_processing(body))
    except ValueError as e:  # SamplingParams says "name=value is invalid: allowed"
        raise bad(str(e), str(e).split("=", 1)[0]) from None


# -- choices: n, logprobs, echo (vLLM's meanings) ---------------------------------------
MAX_CHOICES = 64    # prompts x n in one request


@dataclass(frozen=True)
class ChoiceOptions:
    n: int = 1
    logprobs: int | None = None      # alternatives per sampled token; None: no logprobs
    echo: bool = False               # completions: the prompt before the completion
    echo_only: bool = False          # echo with max_tokens 0: the prompt scored, no output


def choice_options(body: dict, chat: bool) -> ChoiceOptions:
    """n, logprobs and echo from the body; 400 naming the field when out of range."""
    n = get_field(body, "n", "an integer", 1)
    if not 1 <= n <= MAX_CHOICES:
        raise bad(f"n must be in [1, {MAX_CHOICES}], got {n}", "n")
    if chat:
        if get_field(body, "logprobs", "a boolean", False):
            k = get_field(body, "top_logprobs", "an integer", 0)
            _check_top(k, "top_logprobs")
            return ChoiceOptions(n, k)
        if body.get("top_logprobs") is not None:
            raise bad("top_logprobs needs logprobs set to true", "top_logprobs")
        return ChoiceOptions(n)
    k = get_field(body, "logprobs", "an integer")
    if k is not None:
        _check_top(k, "logprobs")
    echo = get_field(body, "echo", "a boolean", False)
    return ChoiceOptions(n, k, echo, echo and body.get("max_tokens") == 0)


def _check_top(k: int, name: str) -> None:
    if not 0 <= k <= MAX_LOGPROBS:
        raise bad(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}", name)


def child_params(params: SamplingParams, opts: ChoiceOptions, j: int) -> SamplingParams:
    """Choice j's parameters (vLLM's rule for n: a seeded request's child j has seed + j;
    echo with logprobs also scores the prompt)."""
    seed = params.seed
    if seed is not None and seed + opts.n - 1 >= MAX_SEED:
        raise bad("seed + n - 1 must be below 2^63 (child j of n is seeded seed + j)", "seed")
    return msgspec.structs.replace(
        params, seed=None if seed is None else seed + j, logprobs=opts.logprobs,
        prompt_logprobs=opts.logprobs if opts.echo and opts.logprobs is not None else None)


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Tokenizes with the GIL released where the tokenizer can (``tokenizers``' batch encode
    does; its single encode does not), so the router's loop runs on meanwhile."""
    inner = getattr(tokenizer, "_tok", None)
    if inner is not None and hasattr(inner, "encode_batch"):
        return inner.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    return tokenizer.encode(text) if add_special_tokens else \
        tokenizer.encode(text, add_special_tokens=False)


def completion_prompt(prompt) -> str | list[int]:
    """One prompt as text or token ids: a string, a list of token ids, or a list holding
    one of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(_KINDS["an integer"](t) for t in prompt):
        return list(prompt)
    if prompt is None:
        raise bad("prompt is required", "prompt")
    raise bad("prompt must be a string, an array of token ids, or an array holding one of "
              f"those; got {_show(prompt)}", "prompt")


def completion_prompts(prompt) -> list[str | list[int]]:
    """A completions request's prompts: one, as completion_prompt takes it, or an array of
    strings or of token-id arrays (one choice each)."""
    if isinstance(prompt, list) and len(prompt) > 1 and all(
            isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_CHOICES:
            raise bad(f"prompt has {len(prompt)} prompts; at most {MAX_CHOICES} are accepted",
                      "prompt")
        return [completion_prompt(p) for p in prompt]
    return [completion_prompt(prompt)]


def completion_prompt_ids(tokenizer, prompt) -> list[int]:
    """completion_prompt, with text encoded with the tokenizer's special tokens (as the
    offline LLM does)."""
    prompt = completion_prompt(prompt)
    return encode_text(tokenizer, prompt) if isinstance(prompt, str) else prompt


def chat_messages(messages, context: int | None = None) -> list[dict]:
    """The messages as [{role, content: str}] (text parts joined with newlines), tool
    calls and results checked against each other (tools.py). More messages than the
    ``context`` has tokens cannot fit (a template writes a token per message) and are
    refused before they are copied (100,000 were templated: 128 MB kept)."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages is required: a non-empty array of {role, content} objects",
                  "messages")
    if context is not None and len(messages) > context:
        raise bad(f"{len(messages)} messages cannot fit the model's context of {context} "
                  "tokens", "messages")
    out, call_ids = [], set()
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad(f"{where} must be an object with role and content", where)
        role, content = msg.get("role"), msg.get("content")
        if role not in CHAT_ROLES:
            raise bad(f"{where}.role must be one of {', '.join(CHAT_ROLES)}; got {_show(role)}",
                      f"{where}.role")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise bad(f"{where}.content[{j}] must be {{\"type\": \"text\", \"text\": "
                              f"string}}: only text content is supported; got {_show(part)}",
                              f"{where}.content")
            content = "\n".join(part["text"] for part in content)
        calls = msg.get("tool_calls") is not None
        if not isinstance(content, str) and not (content is None and calls):
            raise bad(f"{where}.content must be a string or an array of text parts; got "
                      f"{_show(content)}", f"{where}.content")
        if calls or role == "tool":
            out.append(tool_message(msg, where, content, call_ids))
        else:
            out.append({"role": role, "content": content})
    return out


def chat_prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                    family=None) -> list[int]:
    """Renders the chat template and encodes it without adding special tokens, as
    transformers' apply_chat_template(tokenize=True) does: the template itself writes
    any BOS it wants (the bundled one writes none). ``tools`` go to a template that knows
    them; for one that does not, tools.for_template writes the default rendering."""
    messages, tools = for_template(messages, tools, tokenizer.chat_template, family)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tools=tools)
    except (ValueError, jinja2.TemplateError) as e:
        raise bad(f"cannot render the chat template for these messages: {e}",
                  "messages") from None
    return encode_text(tokenizer, text, add_special_tokens=False)


def json_depth_problem(body, limit: int = MAX_JSON_DEPTH) -> str | None:
    """Why ``body`` nests too deep, naming where (a tool's schema, say), or None
    (iterative: no recursion on hostile input; the path is kept per level, not per
    value, so a wide body costs no more than before)."""
    todo, path = [(body, 1, None)], []
    while todo:
        value, depth, key = todo.pop()
        del path[depth - 1:]
        path.append(key)
        if depth > limit:
            where = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path[1:])
            where = where.lstrip(".")
            return (f"the request body nests arrays/objects deeper than {limit} levels, at "
                    f"{where[:80] + '...' if len(where) > 80 else where}")
        if isinstance(value, dict):
            todo.extend((v, depth + 1, k) for k, v in value.items())
        elif isinstance(value, list):
            todo.extend((v, depth + 1, i) for i, v in enumerate(value))
    return None


# -- wire shapes (pure) -------------------------------------------------------------------
def error_body(err: RequestError) -> dict:
    status = err.http_status
    kind = {401: "authentication_error", 429: "rate_limit_error"}.get(status) or (
        "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": err.message, "type": kind, "param": err.param,
                      "code": err.code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"  # compact, UTF-8 as is


SSE_DONE = b"data: [DONE]\n\n"


def _stop_reason(stop_str: str | None) -> dict:
    """vLLM's ``stop_reason``, only when a stop string ended the choice (Messages: its
    ``stop_sequence``)."""
    return {} if stop_str is None else {"stop_reason": stop_str}


@dataclass
class Reply:
    """The response objects of one request, chat or text completion."""
    chat: bool
    id: str
    created: int
    model: str
    include_usage: bool = False
    continuous_usage: bool = False   # usage (so far) in every chunk

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, text: str = "", finish_reason: str | None = None,
              role: bool = False, index: int = 0, logprobs: dict | None = None,
              progress: dict | None = None, tool_calls: list[dict] | None = None,
              stop_str: str | None = None) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text} if role else \
                ({"content": text} if text or finish_reason is None and not tool_calls
                 else {})
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason, **_stop_reason(stop_str)}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            out = {**self._head("text_completion"), "choices": [
                {"index": index, "text": text, "logprobs": logprobs,
                 "finish_reason": finish_reason}]}
        if self.include_usage:
            out["usage"] = progress if self.continuous_usage else None
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(prompt_tokens,
                                                                  completion_tokens)}

    def choice(self, index: int, text: str, finish_reason: str,
               logprobs: dict | None = None, tool_calls: list[dict] | None = None,
               stop_str: str | None = None) -> dict:
        """One choice of a full (non-streamed) response; content is null when the answer
        is only tool calls, as OpenAI's is."""
        if self.chat:
            message = {"role": "assistant", "content": text}
            if tool_calls:
                message.update(content=text or None, tool_calls=tool_calls)
            return {"index": index, "message": message, "logprobs": logprobs,
                    "finish_reason": finish_reason, **_stop_reason(stop_str)}
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": finish_reason, **_stop_reason(stop_str)}

    def full(self, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict:
        head = self._head("chat.completion" if self.chat else "text_completion")
        return {**head, "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}
