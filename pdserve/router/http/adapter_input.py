"""What the Responses and Anthropic adapters check alike in a request they translate
into a chat body (responses_input.py, messages_input.py): one definition of a required
string and of text given as a string or an array of typed text pieces, so both APIs
refuse the same mistakes with the same words (each in its own field paths)."""
from __future__ import annotations

import logging
from typing import Callable

from pdserve.router.http.openai_schema import bad

logger = logging.getLogger(__name__)

MAX_LOGGED_TYPES = 8      # skipped tool types named in the log line (a body may list many)
MAX_LOGGED_TYPE_CHARS = 40


def required_string(obj: dict, name: str, where: str) -> str:
    """``obj[name]``, a non-empty string (an id, a name), else a 400 naming it."""
    value = obj.get(name)
    if not isinstance(value, str) or not value:
        raise bad(f"{where}.{name} is required and must be a non-empty string",
                  f"{where}.{name}")
    return value


def joined_text(content, where: str, kinds: tuple[str, ...], noun: str) -> str:
    """``content``: a string, or an array of text pieces (``{"type": one of kinds,
    "text": str}``), joined with newlines; anything else (an image, a document) is a
    400 naming the piece, as only text is served."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or an array of text {noun}s", where)
    texts = []
    for j, piece in enumerate(content):
        if not (isinstance(piece, dict) and piece.get("type") in kinds
                and isinstance(piece.get("text"), str)):
            kind = piece.get("type") if isinstance(piece, dict) else type(piece).__name__
            raise bad(f"{where}[{j}] must be a text {noun} ({', '.join(kinds)}): only text "
                      f"is supported; got {kind!r}", f"{where}[{j}]")
        texts.append(piece["text"])
    return "\n".join(texts)


def chat_tools(tools, served: Callable[[dict], bool], where: Callable[[int], str],
               convert: Callable[[dict, str], dict], request_id: str,
               skipped_why: str) -> list[dict] | None:
    """The tools ``served`` accepts, each made a chat tool by ``convert(tool, path)``;
    the others (tools only their own platform runs) are skipped, named in one log line
    (a few of their types, shortened: the body is the client's). ``where(i)`` is the
    client's path of tool i, for errors. None when no tool is left."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("tools must be an array of tools", "tools")
    out, skipped = [], set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise bad(f"{where(i)} must be an object", where(i))
        if served(tool):
            out.append({"type": "function", "function": convert(tool, where(i))})
        elif len(skipped) < MAX_LOGGED_TYPES:
            skipped.add(str(tool.get("type"))[:MAX_LOGGED_TYPE_CHARS])
    if skipped:
        logger.info("%s: skipped tool types %s (%s)", request_id, sorted(skipped),
                    skipped_why)
    return out or None
