"""What the Responses and Anthropic adapters check alike in a request they translate
into a chat body (responses_input.py, messages_input.py): one definition of a required
string and of text given as a string or an array of typed text pieces, so both APIs
refuse the same mistakes with the same words (each in its own field paths)."""
from __future__ import annotations

from pdserve.router.http.openai_schema import bad


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
