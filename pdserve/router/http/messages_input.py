"""An Anthropic Messages request (``POST /v1/messages``) as a chat completions body: the
adapter's one translation, pure. ``system`` (a string or text blocks) -> a system
message; content blocks ``text``, ``tool_use`` (-> assistant ``tool_calls``) and
``tool_result`` (-> ``role: "tool"`` messages); tools with ``input_schema`` -> chat
function tools; ``tool_choice`` auto/any/tool/none -> auto/required/named/none;
``stop_sequences`` -> ``stop``. Anthropic's error types: ``error_type``. What is
refused and what is ignored: docs/http-api.md."""
from __future__ import annotations

import json

from pdserve.router.http import adapter_input
from pdserve.router.http.adapter_input import joined_text, required_string
from pdserve.router.http.openai_schema import bad, get_field
from pdserve.router.streams import OVERLOADED, RequestError

_STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                 403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                 429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}


def error_type(err: RequestError, status: int | None = None) -> str:
    """Anthropic's error type of a RequestError answered with HTTP ``status`` (its own
    by default; a full queue is overloaded, not a rate limit: the client did nothing
    wrong). Another 4xx (a 405) is the client's mistake: invalid_request_error."""
    if err.code == OVERLOADED:
        return "overloaded_error"
    status = status or err.http_status
    return _STATUS_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(err: RequestError, status: int | None = None) -> dict:
    return {"type": "error", "error": {"type": error_type(err, status),
                                       "message": err.message}}


def _text_blocks(blocks, where: str) -> str:
    return joined_text(blocks, where, ("text",), "block")


def _user(content: list, where: str, calls: set[str]) -> list[dict]:
    """A user turn's blocks: each tool_result its own tool message (first, in order), the
    text blocks one user message after them."""
    out, texts = [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result":
            call_id = required_string(block, "tool_use_id", at)
            if call_id not in calls:
                raise bad(f"{at}.tool_use_id {call_id!r} matches no tool_use block of an "
                          "earlier assistant message", f"{at}.tool_use_id")
            result = block.get("content")
            text = _text_blocks(result if result is not None else "", f"{at}.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise bad(f"{at} must be a text or tool_result block; got {kind!r} (images and "
                      "documents are not supported)", at)
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant(content: list, where: str, calls: set[str]) -> dict:
    texts, tool_calls = [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use":
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise bad(f"{at}.input must be an object", f"{at}.input")
            call_id = required_string(block, "id", at)
            calls.add(call_id)
            tool_calls.append({"id": call_id, "type": "function", "function": {
                "name": required_string(block, "name", at),
                "arguments": json.dumps(arguments)}})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # a thinking model's reasoning sent back: nothing to render
        else:
            raise bad(f"{at} must be a text or tool_use block; got {kind!r}", at)
    message = {"role": "assistant", "content": "\n".join(texts)}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def chat_messages(body: dict) -> list[dict]:
    """``system`` and ``messages`` as chat messages."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages is required: a non-empty array of {role, content}", "messages")
    system = body.get("system")
    out = [] if not system else [{"role": "system",
                                  "content": _text_blocks(system, "system")}]
    calls: set[str] = set()
    for i, msg in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
            raise bad(f"{where}.role must be user or assistant", f"{where}.role")
        content = msg.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise bad(f"{where}.content must be a string or an array of content blocks",
                      f"{where}.content")
        if msg["role"] == "user":
            out += _user(content, where, calls)
        else:
            out.append(_assistant(content, where, calls))
    return out


# The chat fields an error of the chat path may name, as this API's (chat_reading.renamed).
_CHAT_NAMES = {"stop(?==|$)": "stop_sequences"}
_TOOL_FIELDS = {"": "", "parameters": ".input_schema"}


def _served(tool) -> bool:
    """Whether a tool becomes a chat tool (server tools are skipped)."""
    return isinstance(tool, dict) and tool.get("type") in (None, "custom")


def chat_names(body: dict) -> tuple:
    """The arguments of chat_reading.renamed for this request: an error of the chat path
    named in this API's fields."""
    tools = body.get("tools") if isinstance(body.get("tools"), list) else []
    return _CHAT_NAMES, lambda i, name: f"tools.{i}" + _TOOL_FIELDS.get(name, f".{name}"), \
        [i for i, tool in enumerate(tools) if _served(tool)]


def chat_tools(tools, request_id: str) -> list[dict] | None:
    """Client tools (``{name, description, input_schema}``) as chat function tools;
    server tools (``web_search_...``, ``bash_...``: a ``type`` other than custom) are
    skipped with one log line, as the Responses adapter skips hosted tools."""
    return adapter_input.chat_tools(tools, _served, "tools.{}".format, _function,
                                    f"message {request_id}", "only client tools are served")


def _function(tool: dict, where: str) -> dict:
    function = {"name": required_string(tool, "name", where)}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise bad(f"{where}.input_schema is required and must be a JSON Schema object",
                  f"{where}.input_schema")
    function["parameters"] = schema
    return function


def chat_tool_choice(choice, tools: list[dict] | None) -> tuple[object, bool | None]:
    """(chat tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type") if isinstance(choice, dict) else None
    disable = choice.get("disable_parallel_tool_use") if kind else None
    if disable is not None and not isinstance(disable, bool):
        raise bad(f"tool_choice.disable_parallel_tool_use must be a boolean, got {disable!r}",
                  "tool_choice.disable_parallel_tool_use")
    parallel = None if disable is None else not disable
    if kind in ("auto", "none"):
        return kind, parallel
    if kind in ("any", "tool") and not tools:
        raise bad(f"tool_choice {kind} needs tools", "tool_choice")
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        name = choice.get("name")
        known = [t["function"]["name"] for t in tools]
        if name not in known:
            raise bad(f"tool_choice names tool {name!r}, which is not in tools (tools: "
                      f"{known})", "tool_choice.name")
        return {"type": "function", "function": {"name": name}}, parallel
    raise bad("tool_choice.type must be auto, any, tool or none", "tool_choice.type")


def chat_body(body: dict, request_id: str, count_only: bool = False) -> dict:
    """The chat completions body of a Messages request (``count_only``: of a count_tokens
    one, which has no max_tokens)."""
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict)
                                     and thinking.get("type") in (None, "disabled")):
        raise bad("thinking is not supported by this server; leave it out or set its type "
                  "to disabled", "thinking")
    out = {"model": body.get("model"), "messages": chat_messages(body)}
    tools = chat_tools(body.get("tools"), request_id)
    if tools is not None:
        out["tools"] = tools
    choice, parallel = chat_tool_choice(body.get("tool_choice"), tools)
    if choice is not None and (tools is not None or choice == "none"):
        out["tool_choice"] = choice
    if parallel is not None:
        out["parallel_tool_calls"] = parallel
    if count_only:
        return out
    max_tokens = get_field(body, "max_tokens", "an integer")
    if max_tokens is None or max_tokens < 1:
        raise bad("max_tokens is required: an integer >= 1", "max_tokens")
    out["max_tokens"] = max_tokens
    out["stream"] = get_field(body, "stream", "a boolean", False)
    if out["stream"]:
        out["stream_options"] = {"include_usage": True}
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad("stop_sequences must be an array of strings", "stop_sequences")
        out["stop"] = stop
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            out[name] = body[name]
    return out
