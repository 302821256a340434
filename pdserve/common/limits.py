"""The bounds every side checks, written once: the numbers, the msgspec field types that
carry them (msgspec checks those in C while decoding), and ``allowed``, which says a
type's bounds in words for the error a user or a peer gets.

A leaf: msgspec only, nothing of pdserve and no torch, so that the protocol, the queue
clients, the router's HTTP edge and the engine (through common/sampling.py) share it.
"""
from typing import Annotated, Any

import msgspec
from msgspec import Meta

MAX_WIRE_INT = 2**63    # counts and ids on the wire are below this (int64 on every side)
MAX_SEED = 2**63        # seeds are in [0, 2^63): a signed 64-bit value on every side
MAX_INT = 2**31         # a count or token id a request may name (the model's own bounds,
#                         context and vocabulary, are checked later, where they are known)
MAX_LOGPROBS = 20       # alternatives per token (OpenAI's and vLLM's default limit)
MAX_ID_CHARS = 1024     # request, node and segment ids, dtype and reason codes
MAX_TEXT_CHARS = 65536  # free text: reasons, error messages, addresses
MAX_ITEMS = 1 << 20     # entries of any list a message carries (tokens, requests, ...)
MAX_INDEX_BLOCKS = 1 << 20  # block keys a router indexes per node (and an IndexDump carries)

# ---------------------------------------------------------------- field types with limits
Count = Annotated[int, Meta(ge=0, le=MAX_WIRE_INT - 1)]        # sizes, indices, pids
Int64 = Annotated[int, Meta(ge=-MAX_WIRE_INT, le=MAX_WIRE_INT - 1)]  # token ids on the
# wire: the receiver checks the vocabulary and fails only that request
Seed = Annotated[int, Meta(ge=0, le=MAX_SEED - 1)]
UInt64 = Annotated[int, Meta(ge=0)]                            # XXH3 checksums (< 2^64)
Id = Annotated[str, Meta(max_length=MAX_ID_CHARS)]
Text = Annotated[str, Meta(max_length=MAX_TEXT_CHARS)]
TokenIds = Annotated[list[Int64], Meta(max_length=MAX_ITEMS)]


def list_of(tp: Any, max_length: int = MAX_ITEMS) -> Any:
    """list[tp] of at most max_length entries (a schema limit msgspec enforces)."""
    return Annotated[list[tp], Meta(max_length=max_length)]


# ---------------------------------------------------------------- the limits in words
_NOUNS = {"int": ("an integer", "integers"), "float": ("a number", "numbers"),
          "bool": ("a boolean", "booleans"), "str": ("a string", "strings")}


def _num(v) -> str:
    """2^k for the big powers of two the limits are made of, the number otherwise."""
    v = int(v) if isinstance(v, float) and v.is_integer() else v
    if isinstance(v, int) and v >= 1 << 16 and v & (v - 1) == 0:
        return f"2^{v.bit_length() - 1}"
    return str(v)


def _range(t) -> str:
    """' in [lo, hi)' of a number type's bounds (nothing for the whole int64 range)."""
    lo, hi = (t.ge, t.gt), (t.le, t.lt)
    if isinstance(t, msgspec.inspect.IntType):
        if t.le is not None and (t.le + 1) & t.le == 0 and t.le >= 1 << 16:
            hi = (None, t.le + 1)   # [.., 2^k - 1] reads better as [.., 2^k)
        if (t.ge, hi[1]) == (-MAX_WIRE_INT, MAX_WIRE_INT):
            return ""
    if lo == (None, None) and hi == (None, None):
        return ""
    if hi == (None, None):
        return f" >= {_num(t.ge)}" if t.ge is not None else f" > {_num(t.gt)}"
    if lo == (None, None):
        return f" <= {_num(t.le)}" if hi[0] is not None else f" < {_num(hi[1])}"
    left = f"[{_num(lo[0])}" if lo[0] is not None else f"({_num(lo[1])}"
    right = f"{_num(hi[0])}]" if hi[0] is not None else f"{_num(hi[1])})"
    return f" in {left}, {right}"


def _words(t, many: bool, none: str) -> str:
    I = msgspec.inspect  # noqa: E741, N806
    note = ""
    if isinstance(t, I.Metadata):
        note = (t.extra_json_schema or {}).get("description", "")
        note, t = (f" ({note})" if note else ""), t.type
    if isinstance(t, (I.IntType, I.FloatType, I.BoolType)):
        kind = {I.IntType: "int", I.FloatType: "float", I.BoolType: "bool"}[type(t)]
        bounds = "" if kind == "bool" else _range(t)
        return _NOUNS[kind][many] + bounds + note
    if isinstance(t, I.StrType):
        noun = _NOUNS["str"][many]
        if t.min_length:
            noun = ("a non-empty string", "non-empty strings")[many]
        if t.max_length is not None:
            noun += f" of at most {_num(t.max_length)} characters"
        return noun + note
    if isinstance(t, (I.ListType, I.DictType)):
        head = ("a list", "lists")[many] if isinstance(t, I.ListType) else ("a map", "maps")[many]
        size = f" (at most {_num(t.max_length)})" if t.max_length is not None else ""
        if isinstance(t, I.ListType):
            return f"{head}{size} of {_words(t.item_type, True, none)}{note}"
        return (f"{head}{size} of {_words(t.key_type, True, none)} to "
                f"{_words(t.value_type, True, none)}{note}")
    if isinstance(t, I.TupleType):
        return "(" + "; ".join(_words(x, False, none) for x in t.item_types) + ")" + note
    if isinstance(t, I.LiteralType):
        return "one of " + ", ".join(map(repr, t.values)) + note
    if isinstance(t, I.UnionType):
        kinds = [x for x in t.types if not isinstance(x, I.NoneType)]  # (UNSET is not listed)
        words = " or ".join(_words(x, many, none) for x in kinds)
        return words + (f" or {none}" if any(isinstance(x, I.NoneType) for x in t.types)
                        else "") + note
    return str(t)


def allowed(struct: type, none: str = "None") -> dict[str, str]:
    """What each field of ``struct`` accepts, in words drawn from its type and limits (for
    "field X must be <this>"); a field's Meta(description=...) is added in brackets."""
    info = msgspec.inspect.type_info(struct)
    return {f.encode_name: _words(f.type, False, none) for f in info.fields}
