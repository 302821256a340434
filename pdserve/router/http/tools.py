"""Tool calling on /v1/chat/completions, the request side: ``tools``, ``tool_choice`` and
``parallel_tool_calls`` read and checked at the edge (a 400 naming the field), the
messages that carry calls and their results checked against each other, the tools and
calls rendered for a chat template that knows no tools, and the grammar that constrains
the answer (tool_parsers.py: the families, the grammar, the streaming parser).

``tool_choice``: ``none`` (tools shown to the model, the answer is text), ``auto`` (text,
or calls parsed in the family's syntax, constrained once opened), ``required`` (one call
or more, of any tool) or ``{"type": "function", "function": {"name": N}}`` (one call of
N). The default is auto with tools, none without (OpenAI's).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pdserve.router.http.structured import find_guide
from pdserve.router.http.tool_parsers import (
    FAMILIES,
    Family,
    ToolStream,
    default_family,
    grammar,
)
from pdserve.router.streams import BAD_REQUEST, RequestError

MAX_TOOLS = 128     # OpenAI's own limit; each is a grammar alternative and prompt text
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")   # OpenAI's rule for a function's name
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def _bad(message: str, param: str) -> RequestError:
    return RequestError(BAD_REQUEST, message, param)


def _show(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict]                  # {"type": "function", "function": {...}}, checked
    schemas: list[tuple[str, dict]]    # (name, parameters schema)
    choice: str                        # "none", "auto", "required" or "function"
    forced: str | None                 # grammar(): None auto, "" required, or the name
    parallel: bool
    family: Family

    def stream(self) -> ToolStream | None:
        """A choice's parser; None when the answer is only text (tool_choice none)."""
        return None if self.choice == "none" else ToolStream(self.family)


def tool_plan(body: dict, parser: str | None, chat_template: str | None) -> ToolPlan | None:
    """The request's tools and choice, checked; None when it has neither."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad(f"parallel_tool_calls must be a boolean, got {_show(parallel)}",
                   "parallel_tool_calls")
    if raw is None and choice is None:
        return None
    tools = _tools(raw if raw is not None else [])
    names = [t["function"]["name"] for t in tools]
    if choice is None:
        choice = "auto" if tools else "none"
    forced: str | None = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise _bad('tool_choice as an object must be {"type": "function", "function": '
                       f'{{"name": NAME}}}}; got {_show(choice)}', "tool_choice")
        if name not in names:
            raise _bad(f"tool_choice names function {name!r}, which is not in tools "
                       f"(tools: {_show(names)})", "tool_choice")
        choice, forced = "function", name
    elif choice not in ("none", "auto", "required"):
        raise _bad("tool_choice must be none, auto, required or {\"type\": \"function\", "
                   f"\"function\": {{\"name\": NAME}}}}; got {_show(choice)}", "tool_choice")
    elif choice == "required":
        forced = ""
    if choice in ("required", "function") and not tools:
        raise _bad(f"tool_choice {choice!r} needs tools", "tool_choice")
    if choice == "auto" and not tools:
        choice = "none"
    family = FAMILIES[parser] if parser else default_family(chat_template)
    schemas = [(t["function"]["name"], t["function"].get("parameters") or NO_PARAMETERS)
               for t in tools]
    # More than one call only when asked for: a small model left free to go on repeats
    # its call until max_tokens (OpenAI's default is true; docs/http-api.md says so).
    return ToolPlan(tools, schemas, choice, forced, parallel is True, family)


def _tools(raw) -> list[dict]:
    if not isinstance(raw, list):
        raise _bad(f"tools must be an array of function tools, got {_show(raw)}", "tools")
    if len(raw) > MAX_TOOLS:
        raise _bad(f"tools has {len(raw)} tools; at most {MAX_TOOLS} are accepted", "tools")
    out, seen = [], set()
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" \
                or not isinstance(tool.get("function"), dict):
            raise _bad(f'{where} must be {{"type": "function", "function": {{name, '
                       f'description, parameters}}}}; got {_show(tool)}', where)
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise _bad(f"{where}.function.name must be 1 to 64 letters, digits, _ or -; "
                       f"got {_show(name)}", f"{where}.function.name")
        if name in seen:
            raise _bad(f"{where}.function.name {name!r} is given twice",
                       f"{where}.function.name")
        seen.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise _bad(f"{where}.function.description must be a string",
                       f"{where}.function.description")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _bad(f"{where}.function.parameters must be a JSON schema object, got "
                       f"{_show(params)}", f"{where}.function.parameters")
        out.append({"type": "function", "function": {
            k: fn[k] for k in ("name", "description", "parameters", "strict")
            if fn.get(k) is not None}})
    return out


async def prepare_tools(body: dict, core) -> ToolPlan | None:
    """The request's plan; when calls are possible, its grammar becomes the request's
    guide (checked in the router's guide checker, off the event loop). A schema llguidance
    cannot use is a 400 naming that tool."""
    plan = tool_plan(body, core.config.tool_call_parser, core.tokenizer.chat_template)
    if plan is None or plan.choice == "none":
        return plan
    found = find_guide(body)
    if found is not None:
        raise _bad(f"{found[0]} cannot be combined with tools unless tool_choice is none: "
                   "the tool calls are themselves constrained", found[0])
    spec = grammar(plan.family, plan.schemas, plan.forced, plan.parallel)
    if await core.guides.problem("grammar", spec):
        for i, (_, schema) in enumerate(plan.schemas):
            problem = await core.guides.problem("json", json.dumps(schema))
            if problem:
                raise _bad(f"tools[{i}].function.parameters is not a JSON schema this server "
                           f"can use: {problem}", f"tools[{i}].function.parameters")
        problem = await core.guides.problem("grammar", spec)
        raise _bad(f"tools: the grammar of these tools cannot be used: {problem}", "tools")
    body["structured_outputs"] = {"grammar": spec}
    return plan


# -- messages ---------------------------------------------------------------------------
def tool_message(msg: dict, where: str, content: str | None, call_ids: set[str]) -> dict:
    """An assistant message with ``tool_calls`` or a ``tool`` message, checked; the ids of
    the calls seen so far are in ``call_ids`` (a result must answer one of them)."""
    if msg["role"] == "tool":
        call_id = msg.get("tool_call_id")
        if not isinstance(call_id, str):
            raise _bad(f"{where}.tool_call_id is required on a tool message",
                       f"{where}.tool_call_id")
        if call_id not in call_ids:
            raise _bad(f"{where}.tool_call_id {call_id!r} matches no tool call of an earlier "
                       "assistant message", f"{where}.tool_call_id")
        return {"role": "tool", "tool_call_id": call_id, "content": content or ""}
    calls = msg.get("tool_calls")
    if msg["role"] != "assistant" or not isinstance(calls, list):
        raise _bad(f"{where}.tool_calls must be an array, on an assistant message",
                   f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(call.get("id"), str) \
                or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments"), str):
            raise _bad(f'{at} must be {{"id", "type": "function", "function": {{"name", '
                       f'"arguments": JSON text}}}}; got {_show(call)}', at)
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            raise _bad(f"{at}.function.arguments must be JSON text of an object; got "
                       f"{_show(fn['arguments'])}", f"{at}.function.arguments") from None
        call_ids.add(call["id"])
        # transformers' convention: a template reads arguments as a mapping
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return {"role": "assistant", "content": content or "", "tool_calls": out}


def knows_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def for_template(messages: list[dict], tools: list[dict] | None, chat_template: str | None,
                 family: Family | None = None) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) as the template gets them: as they are for a template that knows
    tools (transformers' ``tools=``), else the default rendering: the tools described in
    the system message, calls written in the family's syntax in the assistant's text, and
    results as a user turn of ``<tool_response>`` blocks (Qwen2.5's own rendering)."""
    has_calls = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if knows_tools(chat_template) or not (tools or has_calls):
        return messages, tools or None
    family = family or default_family(chat_template)
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_results": True})
        elif m.get("tool_calls"):
            calls = family.write([(c["function"]["name"], json.dumps(c["function"]["arguments"]))
                                  for c in m["tool_calls"]])
            out.append({"role": "assistant",
                        "content": (m["content"] + "\n" if m["content"] else "") + calls})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("_results", None)
    if tools:
        prompt = tools_prompt(tools, family)
        if out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def tools_prompt(tools: list[dict], family: Family) -> str:
    example = family.write([("<function-name>", "<args-json-object>")])
    return ("# Tools\n\nYou may call one or more functions to assist with the user query."
            "\n\nYou are provided with function signatures within <tools></tools> XML tags:"
            "\n<tools>\n" + "\n".join(json.dumps(t) for t in tools) + "\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            f"as follows:\n{example}")
