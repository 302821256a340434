"""A Responses API request (``POST /v1/responses``) as a chat completions body: the
adapter's one translation, pure. ``instructions`` -> a system message; ``input`` (a
string, or items: messages, ``function_call``, ``function_call_output``) -> chat
messages, function calls as assistant ``tool_calls`` and their outputs as ``role:
"tool"`` messages; flat function tools -> chat function tools (other tool types are
skipped, logged once per request); ``text.format`` -> ``response_format``;
``max_output_tokens`` -> ``max_tokens``. What is refused and what is ignored:
docs/http-api.md."""
from __future__ import annotations

from pdserve.router.http import adapter_input
from pdserve.router.http.adapter_input import joined_text, required_string
from pdserve.router.http.openai_schema import bad, get_field

# Known fields that change what is generated and are not implemented: refused unless
# neutral (absent, null, or the value shown).
_REFUSED = {"background": (False,), "top_logprobs": (0,), "truncation": ("disabled",),
            "conversation": (), "prompt": ()}
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("user", "system", "developer", "assistant")


def _refuse_unsupported(body: dict) -> None:
    for name, fine in _REFUSED.items():
        value = body.get(name)
        if value is not None and not any(value == f and type(value) is type(f)
                                         for f in fine):
            allowed = " or ".join(repr(f) for f in fine)
            raise bad(f"{name}={value!r} is not supported by this server; leave it out"
                      + (f" or set it to {allowed}" if allowed else ""), name)


def _text(content, where: str) -> str:
    return joined_text(content, where, _TEXT_PARTS, "part")


def input_messages(items, history: list[dict]) -> list[dict]:
    """``input`` as chat messages, after ``history`` (the stored conversation a
    previous_response_id names). A function_call_output must answer a function_call of
    the conversation: else the chat template would render a result of no call."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad("input is required: a string or a non-empty array of items", "input")
    out: list[dict] = []
    calls = {c["id"] for m in history for c in m.get("tool_calls") or ()}
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object (a message or a function_call item)", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad(f"{where}.role must be one of {', '.join(_ROLES)}; got {role!r}",
                          f"{where}.role")
            out.append({"role": role, "content": _text(item.get("content"),
                                                       f"{where}.content")})
        elif kind == "function_call":
            call_id, arguments = required_string(item, "call_id", where), item.get("arguments")
            if arguments in (None, ""):  # a parameterless call
                arguments = "{}"
            if not isinstance(arguments, str):  # 0, [] or false are no call's arguments
                raise bad(f"{where}.arguments must be a string of JSON", f"{where}.arguments")
            call = {"id": call_id, "type": "function", "function": {
                "name": required_string(item, "name", where), "arguments": arguments}}
            calls.add(call["id"])
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # one turn, several calls
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = required_string(item, "call_id", where)
            if call_id not in calls:
                raise bad(f"{where}.call_id {call_id!r} matches no function_call of this "
                          "conversation: send that function_call item before it, or the "
                          "previous_response_id of the response that made it",
                          f"{where}.call_id")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": _text(output if output is not None else "",
                                         f"{where}.output")})
        elif kind == "reasoning":
            continue  # a reasoning model's summary sent back (Codex does): nothing to render
        else:
            raise bad(f"{where}.type {kind!r} is not supported: input items are message, "
                      "function_call, function_call_output (and reasoning, skipped)",
                      f"{where}.type")
    return out


# The chat fields an error of the chat path may name, as this API's (chat_reading.renamed).
_CHAT_NAMES = {"max_tokens": "max_output_tokens",
               r"response_format(?:\.json_schema)?": "text.format"}


def _served(tool) -> bool:
    """Whether a tool becomes a chat tool (hosted tools are skipped)."""
    return isinstance(tool, dict) and tool.get("type") == "function"


def chat_names(body: dict) -> tuple:
    """The arguments of chat_reading.renamed for this request: an error of the chat path
    named in this API's fields."""
    tools = body.get("tools") if isinstance(body.get("tools"), list) else []
    return _CHAT_NAMES, lambda i, name: f"tools[{i}]" + (f".{name}" if name else ""), \
        [i for i, tool in enumerate(tools) if _served(tool)]


def chat_tools(tools, request_id: str) -> list[dict] | None:
    """Responses' flat function tools as chat tools; other tool types (web_search,
    file_search, mcp, ...: hosted tools this server cannot run) are skipped with one log
    line, as a client that lists them (Codex does) still wants an answer."""
    return adapter_input.chat_tools(tools, _served, "tools[{}]".format, _function,
                                    f"response {request_id}", "only function tools are served")


def _function(tool: dict, where: str) -> dict:
    function = {"name": required_string(tool, "name", where)}
    for name in ("description", "parameters"):
        if tool.get(name) is not None:
            function[name] = tool[name]
    return function


def chat_tool_choice(choice, tools: list[dict] | None):
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        known = [t["function"]["name"] for t in tools or ()]
        if name not in known:
            raise bad(f"tool_choice names function {name!r}, which is not in tools "
                      f"(functions: {known})", "tool_choice")
        return {"type": "function", "function": {"name": name}}
    raise bad(f"tool_choice must be none, auto, required or {{\"type\": \"function\", "
              f"\"name\": ...}}; got {choice!r}", "tool_choice")


def response_format(text) -> dict | None:
    """``text.format`` as chat's ``response_format``."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad("text must be an object with format", "text")
    fmt = text.get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_object", "json_schema",
                                                            "text"):
        raise bad("text.format.type must be text, json_object or json_schema",
                  "text.format")
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    schema = {"name": fmt.get("name") or "response", "schema": fmt.get("schema")}
    if fmt.get("strict") is not None:
        schema["strict"] = fmt["strict"]
    return {"type": "json_schema", "json_schema": schema}


def chat_body(body: dict, history: list[dict], request_id: str) -> tuple[dict, list[dict]]:
    """The chat completions body of a Responses request whose earlier turns (from
    previous_response_id) are ``history``, and the conversation to store with its answer
    (``history`` and the input, without the instructions: a follow-up sends its own)."""
    _refuse_unsupported(body)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions must be a string", "instructions")
    conversation = history + input_messages(body.get("input"), history)
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + \
        conversation
    out = {"model": body.get("model"), "messages": messages,
           "stream": get_field(body, "stream", "a boolean", False)}
    if out["stream"]:
        out["stream_options"] = {"include_usage": True}
    tools = chat_tools(body.get("tools"), request_id)
    if tools is not None:
        out["tools"] = tools
    choice = chat_tool_choice(body.get("tool_choice"), tools)
    if choice is not None and (tools is not None or choice == "none"):
        out["tool_choice"] = choice
    elif choice == "required":
        raise bad("tool_choice is required, but no function tools were given", "tool_choice")
    fmt = response_format(body.get("text"))
    if fmt is not None:
        out["response_format"] = fmt
    max_output = get_field(body, "max_output_tokens", "an integer")
    if max_output is not None:
        if max_output < 1:
            raise bad(f"max_output_tokens must be >= 1, got {max_output}", "max_output_tokens")
        out["max_tokens"] = max_output
    for name in ("temperature", "top_p", "parallel_tool_calls"):
        if body.get(name) is not None:
            out[name] = body[name]
    return out, conversation
