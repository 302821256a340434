"""Tool calls in the model's own words: per model family, how calls are written (the text a
chat template shows the model, and the text the model writes back), the llguidance grammar
that constrains a call to the tools' schemas, and a streaming parser that turns the text
back into OpenAI's ``tool_calls``.

Families (``--tool-call-parser``, default read from the chat template):

- ``hermes`` (Qwen2.5, Hermes; also the default rendering of a template that knows no
  tools): ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>``, one block per
  call, text before the first allowed.
- ``llama3`` (Llama 3.1/3.2 JSON tool calling): the output is ``{"name": N, "parameters":
  {...}}``, calls joined by ``; ``; no text before (the output starts with ``{``).
- ``mistral``: ``[TOOL_CALLS][{"name": N, "arguments": {...}}, ...]``, text before
  allowed. The marker is matched as text: a tokenizer whose ``[TOOL_CALLS]`` is a special
  token is not supported.

Every call is grammar-constrained (common/guides.py's llguidance): with ``tool_choice``
auto the grammar is free text that cannot contain the family's marker, or free text up to
the first marker and then only calls whose names are the tools' and whose arguments match
that tool's JSON schema (llguidance's ``%json``), written with the same separators as
structured output. So the parser meets one exact spelling of a call and can stream the
arguments byte for byte as the model writes them.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from pdserve.common.guides import JSON_OPTIONS

TEXT, START, HEAD, ARGS, TAIL, DONE, PLAIN = range(7)


@dataclass(frozen=True)
class Family:
    name: str
    open: str        # the marker before the calls; "": the output starts with a call
    key: str         # the key of the arguments in a call's object
    end_call: str    # after a call's arguments
    next_call: str   # between two calls
    close: str       # after the last call

    def head(self, name: str) -> str:
        return '{"name": ' + json.dumps(name) + ', "' + self.key + '": '

    def write(self, calls: list[tuple[str, str]]) -> str:
        """The text of (name, arguments JSON text) calls, as the model writes them."""
        return self.open + self.next_call.join(
            self.head(name) + args + self.end_call for name, args in calls) + self.close


FAMILIES = {
    "hermes": Family("hermes", "<tool_call>\n", "arguments", "}\n</tool_call>",
                     "\n<tool_call>\n", ""),
    "llama3": Family("llama3", "", "parameters", "}", "; ", ""),
    "mistral": Family("mistral", "[TOOL_CALLS][", "arguments", "}", ", ", "]"),
}
PARSERS = tuple(FAMILIES)


def default_family(chat_template: str | None) -> Family:
    """The family a chat template writes tool calls in; hermes for one that knows none
    (the default rendering, tools.py, writes calls as hermes does)."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return FAMILIES["mistral"]
    if "<|python_tag|>" in template or "ipython" in template:
        return FAMILIES["llama3"]
    return FAMILIES["hermes"]


# -- the grammar ------------------------------------------------------------------------
def _lit(text: str) -> str:
    return json.dumps(text)  # a Lark string literal: JSON's escapes are Lark's


def _rx(text: str) -> str:
    """``text`` as a regex matching it literally, inside a Lark /.../ terminal."""
    return "".join("\\n" if c == "\n" else "\\" + c if c in "\\.^$|?*+()[]{}/" else c
                   for c in text)


def grammar(family: Family, tools: list[tuple[str, dict]], forced: str | None,
            parallel: bool) -> str:
    """The Lark grammar of an answer. ``tools``: (name, parameters schema); ``forced``:
    None (auto: text, or calls), "" (required: one call or more of any tool) or a tool's
    name (that tool, once). ``parallel``: more than one call allowed."""
    chosen = [t for t in tools if forced in (None, "") or t[0] == forced]
    rules, alts = [], []
    for i, (name, schema) in enumerate(chosen):
        alts.append(f"{_lit(family.head(name))} args{i} {_lit(family.end_call)}")
        rules.append(f"args{i}: %json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}))
    many = parallel and forced is None or parallel and forced == ""
    calls = f"call ({_lit(family.next_call)} call)*" if many else "call"
    close = f" {_lit(family.close)}" if family.close else ""
    if forced is not None:
        start = (f"{_lit(family.open)} " if family.open else "") + f"calls{close}"
    elif family.open:
        mark = _rx(family.open)
        rules.append(f"TEXT: /(?s:.+)/ & ~/(?s:.*{mark}.*)/")
        # The text before the first marker and the marker itself are one lexeme: the lexer
        # does not backtrack, so free text and a literal marker cannot be two.
        rules.append(f"OPEN: /(?s:.*){mark}/ & ~/(?s:.*{mark}.+)/")
        start = f"TEXT | OPEN calls{close}"
    else:
        rules.append("TEXT: /(?s:[^{].*)/")
        start = "TEXT | calls"
    return "\n".join([f"start: {start}", f"calls: {calls}", "call: " + " | ".join(alts),
                      *rules]) + "\n"


# -- the parser -------------------------------------------------------------------------
class ToolStream:
    """Text in, (content, ``delta.tool_calls`` entries) out, as the model writes: text
    that may be the start of the family's marker is held back until it is decided; each
    call's first entry carries index, id, type and name with ``arguments: ""``, then its
    arguments follow in pieces, every byte once. ``calls`` holds the whole calls, in
    OpenAI's message shape."""

    def __init__(self, family: Family):
        self.family = family
        self.state = TEXT if family.open else START
        self.buf = ""
        self.calls: list[dict] = []
        self._depth, self._in_str, self._esc = 0, False, False

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """``final``: the answer ends with ``text``, so nothing is held back."""
        self.buf += text
        content, deltas = [], []
        while self.buf:
            before = (self.state, len(self.buf))
            self._step(content, deltas)
            if (self.state, len(self.buf)) == before:
                break  # waiting for more text
        if final:
            content.append(self.finish())
        return "".join(content), _merged(deltas)

    def finish(self) -> str:
        """The text still held back, as content (the output ended in text, or in a call
        cut short, whose unfinished markup is dropped)."""
        rest, self.buf = self.buf, ""
        return rest if self.state in (TEXT, START, PLAIN) else ""

    def _step(self, content: list[str], deltas: list[dict]) -> None:
        f, buf = self.family, self.buf
        if self.state == PLAIN:
            content.append(buf)
            self.buf = ""
        elif self.state == START:  # llama3: a call only as the first thing written
            self.state = HEAD if buf.startswith("{") else PLAIN
        elif self.state == TEXT:
            at = buf.find(f.open)
            if at >= 0:
                content.append(buf[:at])
                self.buf, self.state = buf[at + len(f.open):], HEAD
                return
            hold = next((k for k in range(min(len(buf), len(f.open) - 1), 0, -1)
                         if f.open.startswith(buf[-k:])), 0)
            content.append(buf[:len(buf) - hold])
            self.buf = buf[len(buf) - hold:]
        elif self.state == HEAD:
            self._head(buf, deltas)
        elif self.state == ARGS:
            self._args(buf, deltas)
        elif self.state == TAIL:
            self._tail(buf)
        else:  # DONE: the grammar allows nothing after the calls
            self.buf = ""

    def _head(self, buf: str, deltas: list[dict]) -> None:
        """``{"name": "N", "<key>": `` -> a new call."""
        lead = '{"name": "'
        if not buf.startswith(lead):
            if not lead.startswith(buf):
                self.state = PLAIN  # not a call after all (only without a grammar)
            return
        end = buf.find('"', len(lead))
        if end < 0:
            return
        name = buf[len(lead):end]
        rest = buf[end + 1:]
        key = f', "{self.family.key}": '
        if not rest.startswith(key):
            if not key.startswith(rest):
                self.state = PLAIN
            return
        call_id = "call_" + uuid.uuid4().hex[:24]
        self.calls.append({"id": call_id, "type": "function",
                           "function": {"name": name, "arguments": ""}})
        deltas.append({"index": len(self.calls) - 1, "id": call_id, "type": "function",
                       "function": {"name": name, "arguments": ""}})
        self.buf, self.state = rest[len(key):], ARGS
        self._depth, self._in_str, self._esc = 0, False, False

    def _args(self, buf: str, deltas: list[dict]) -> None:
        """The arguments' JSON, scanned for its end (strings and escapes minded)."""
        end = len(buf)
        for i, ch in enumerate(buf):
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif ch == "\\":
                    self._esc = True
                elif ch == '"':
                    self._in_str = False
            elif ch == '"':
                self._in_str = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    self.state = TAIL
                    break
        piece = buf[:end]
        self.calls[-1]["function"]["arguments"] += piece
        deltas.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})
        self.buf = buf[end:]

    def _tail(self, buf: str) -> None:
        """After the arguments: the call's end, then the next call or the close."""
        f = self.family
        for lit, state in ((f.end_call + f.next_call, HEAD), (f.end_call + f.close, DONE)):
            # Without a close, the end of one call is a prefix of the way to the next.
            if buf.startswith(lit) and (state == HEAD or f.close
                                        or not (f.end_call + f.next_call).startswith(buf)):
                self.buf, self.state = buf[len(lit):], state
                return
        if not any((f.end_call + x).startswith(buf) for x in (f.next_call, f.close)):
            self.state = PLAIN


def _merged(deltas: list[dict]) -> list[dict]:
    """Consecutive argument pieces of one call as one entry (a call's first entry keeps
    its ``arguments: ""``, as OpenAI's does)."""
    out: list[dict] = []
    for d in deltas:
        if out and "id" not in d and "id" not in out[-1] and out[-1]["index"] == d["index"]:
            out[-1]["function"]["arguments"] += d["function"]["arguments"]
        elif "id" in d or d["function"]["arguments"]:
            out.append({**d, "function": dict(d["function"])})
    return out


def parse(family: Family, text: str) -> tuple[str, list[dict]]:
    """A whole answer's (content, calls), by the streaming parser."""
    stream = ToolStream(family)
    return stream.feed(text, final=True)[0], stream.calls


def finish_reason(reason: str | None, stream: ToolStream | None) -> str | None:
    """OpenAI's "tool_calls" for an answer that ended by making calls."""
    return "tool_calls" if stream is not None and stream.calls and reason == "stop" \
        else reason
