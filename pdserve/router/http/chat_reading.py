"""What the Responses and Anthropic adapters read back from the chat path: an assistant
turn (text, tool calls, finish reason, usage), from a full chat completion body or built
chunk by chunk from a stream of chat chunk dicts, in OpenAI's tool-call shape
(``delta.tool_calls[i]`` with ``index``; a call's first delta has ``id``, ``type`` and
``function.name``, its arguments follow in string pieces). Each adapter turns the same
steps into its own events, so neither parses OpenAI chunks itself. A refusal of the
chat path is read back too (``renamed``): named in the fields the client sent."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from pdserve.router.streams import INTERNAL, RequestError


@dataclass
class Call:
    id: str
    name: str
    arguments: str = ""


@dataclass
class Turn:
    """The assistant's turn so far."""
    text: str = ""
    calls: list[Call] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stop_sequence: str | None = None   # the stop string that ended it (vLLM's stop_reason)


# The steps of a streamed turn: ("text", piece), ("call", Call) when a call opens,
# ("args", Call, piece) for a piece of its arguments.
TEXT, CALL, ARGS = "text", "call", "args"


class ChatFailed(Exception):
    """The chat stream ended with an error chunk: ``error`` is its RequestError."""

    def __init__(self, error: RequestError):
        super().__init__(error.message)
        self.error = error


def error_of(chunk: dict) -> RequestError:
    """The RequestError of an OpenAI error body (as a failed chat stream carries it)."""
    err = chunk.get("error") or {}
    return RequestError(err.get("code") or INTERNAL, err.get("message") or "error",
                        err.get("param"))


def read_chunk(chunk: dict, turn: Turn, by_index: dict[int, Call]) -> list[tuple]:
    """The steps of one chat chunk, recorded in ``turn`` as well. ``by_index``: the calls
    opened so far, by their ``index``. Raises ChatFailed on an error chunk."""
    if "error" in chunk:
        raise ChatFailed(error_of(chunk))
    if chunk.get("usage"):
        turn.prompt_tokens = chunk["usage"]["prompt_tokens"]
        turn.completion_tokens = chunk["usage"]["completion_tokens"]
    steps: list[tuple] = []
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content"):
            turn.text += delta["content"]
            steps.append((TEXT, delta["content"]))
        for part in delta.get("tool_calls") or ():
            function = part.get("function") or {}
            call = by_index.get(part.get("index", 0))
            if call is None or part.get("id"):
                call = by_index[part.get("index", 0)] = Call(part.get("id") or "",
                                                             function.get("name") or "")
                turn.calls.append(call)
                steps.append((CALL, call))
            if function.get("arguments"):
                call.arguments += function["arguments"]
                steps.append((ARGS, call, function["arguments"]))
        if choice.get("finish_reason"):
            turn.finish_reason = choice["finish_reason"]
            turn.stop_sequence = choice.get("stop_reason")
    return steps


async def stream_steps(chunks, turn: Turn):
    """The steps of a stream of chat chunk dicts, ``turn`` filled in as they go."""
    by_index: dict[int, Call] = {}
    async for chunk in chunks:
        for step in read_chunk(chunk, turn, by_index):
            yield step


def full_turn(body: dict) -> Turn:
    """The turn of a full (non-streamed) chat completion body."""
    choice = body["choices"][0]
    message = choice["message"]
    calls = [Call(c["id"], c["function"]["name"], c["function"].get("arguments") or "")
             for c in message.get("tool_calls") or ()]
    return Turn(message.get("content") or "", calls, choice["finish_reason"],
                body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"],
                choice.get("stop_reason"))


_CHAT_TOOL = re.compile(r"(?<![\w.\]])tools\[(\d+)\](?:\.function(?:\.(\w+))?)?")


def renamed(err: RequestError, fields: dict[str, str], tool, positions: list[int]
            ) -> RequestError:
    """``err``, raised by the chat path on a translated body, naming what the client sent
    (told of ``max_tokens`` when it sent ``max_output_tokens``, it cannot find its
    mistake). ``fields``: chat field -> the adapter's (a regex); ``tool(i, name)``: how
    the adapter writes field ``name`` ("" for the tool itself) of the client's tool ``i``;
    ``positions``: each chat tool's index in the client's tools (skipped hosted tools
    shift them)."""
    def one_tool(m: re.Match) -> str:
        j = int(m.group(1))
        return tool(positions[j] if j < len(positions) else j, m.group(2) or "")

    def rename(text: str) -> str:
        text = _CHAT_TOOL.sub(one_tool, text)
        for chat, own in fields.items():
            text = re.sub(r"(?<![\w.\[])" + chat + r"(?![\w\]])", own, text)
        return text
    out = RequestError(err.code, rename(err.message),
                       rename(err.param) if err.param else err.param)
    out.counted = err.counted
    return out
