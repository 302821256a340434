"""The fuzz tests' oracle: what docs/protocol.md says a list of frames is, written
independently of pdserve.common.codec's decoder (the code under test, which is msgspec).

``reference(frames, accepted)`` returns the error code the receiver must answer with,
or the tag of the message it must take. It reads only the declared schema (field names
and order, types, defaults and ``Meta`` limits of the wire classes) from the package, as
data, and parses the header with the ``msgpack`` library, not msgspec; the rules are the
document's, in its order: header size, at most one container per 4 bytes, a MessagePack
array ``[version, message]`` (a map with an integer "v" other than ours is an older
peer: version_mismatch), an integer version equal to ours, a message that is an
array led by a known tag, a type this socket takes, every field of its declared type
(array-like structs: fields in declared order, trailing fields with defaults may be left
out, extra trailing entries are ignored; map structs: string keys, unknown keys ignored;
`int` rejects booleans, `float` accepts integers; the limits), tensor frames (KVChunk
only: one frame per entry of ``tensors``, frame indices 1..n each once, dtype x shape =
frame length), and the cross-field rules of Hello and KVChunk.
"""
from __future__ import annotations

import math
import typing

import msgpack
import msgspec

from pdserve.common import errors as E
from pdserve.common import protocol as P

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int32": 4, "int64": 8, "uint8": 1}
BYTES_PER_CONTAINER, MIN_CONTAINERS = 4, 256


class _Bad(Exception):
    pass


def _is_str(value) -> bool:
    """A string of valid UTF-8 (the parser turned invalid bytes into lone surrogates)."""
    return isinstance(value, str) and not any("\udc80" <= c <= "\udcff" for c in value)


def _limits_ok(value, metas) -> bool:
    for m in metas:
        if m.ge is not None and value < m.ge or m.le is not None and value > m.le:
            return False
        if m.max_length is not None and len(value) > m.max_length:
            return False
    return True


def _plain(value, tp):
    """value as plain data of type tp (structs as dicts of their fields); _Bad if it does
    not conform."""
    metas = []
    while typing.get_origin(tp) is typing.Annotated:
        tp, *extra = typing.get_args(tp)
        metas += [m for m in extra if isinstance(m, msgspec.Meta)]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _plain(value, inner)
    if origin is typing.Literal:
        if not _is_str(value) or value not in args:
            raise _Bad
        return value
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return _struct(value, tp)
    if origin is list:
        if not isinstance(value, list) or not _limits_ok(value, metas):
            raise _Bad
        return [_plain(v, args[0]) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise _Bad
        return {_plain(k, args[0]): _plain(v, args[1]) for k, v in value.items()}
    if tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif tp is str:
        ok = _is_str(value)
    else:
        ok = isinstance(value, bool)
    if not ok or (tp in (int, str) and not _limits_ok(value, metas)):
        raise _Bad
    return value


def _struct(value, cls) -> dict:
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = msgspec.structs.fields(cls)
    cfg = cls.__struct_config__
    out = {}
    if cfg.array_like:
        if not isinstance(value, list):
            raise _Bad
        entries = value[1:] if cfg.tag is not None else value
        for i, f in enumerate(fields):
            if i < len(entries):
                out[f.name] = _plain(entries[i], hints[f.name])
            elif f.required:
                raise _Bad
        return out
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise _Bad
    for f in fields:
        if f.name in value:
            out[f.name] = _plain(value[f.name], hints[f.name])
        elif f.required:
            raise _Bad
    return out


def _tensors_ok(metas: dict, frames: list[bytes]) -> bool:
    if len(metas) != len(frames) - 1:
        return False
    if sorted(m["frame"] for m in metas.values()) != list(range(1, len(frames))):
        return False
    return all(math.prod(m["shape"]) * DTYPE_BYTES[m["dtype"]] == len(frames[m["frame"]])
               for m in metas.values())


def _kv_chunk_ok(msg: dict) -> bool:
    """One or more parts (requests), ids unique; each part's blocks after its first_block
    follow the previous part's in every tensor; one checksum per tensor or none;
    first_token only on the last chunk; the pages in tensor frames or in shm, not both."""
    lay, parts, metas = msg["kv_layout"], msg["parts"], msg.get("tensors", {})
    names = [f"{kv}{i}" for i in range(msg["layer_start"], msg["layer_end"]) for kv in "kv"]
    bs = lay["block_size"]
    if not (lay["dtype"] in DTYPE_BYTES and bs > 0
            and 0 <= msg["layer_start"] < msg["layer_end"] <= lay["num_layers"]
            and 1 <= len(parts) <= P.MAX_KV_PARTS
            and len({p["req_id"] for p in parts}) == len(parts)):
        return False
    if len(msg.get("checksums", [])) not in (0, len(names)):
        return False
    total = 0
    for part in parts:
        blocks, first = -(-part["num_tokens"] // bs), part.get("first_block", 0)
        if (part["num_tokens"] <= 0 or not 0 <= first < blocks
                or (part.get("first_token") is not None and not msg["last"])):
            return False
        total += blocks - first
    shm = msg.get("shm")
    if shm is not None:
        return (not metas and len(shm["offsets"]) == len(names)
                and len(shm["block_ids"]) == total)
    shape = [total, bs, lay["num_kv_heads"], lay["head_dim"]]
    return (sorted(metas) == sorted(names)
            and all(m["shape"] == shape and m["dtype"] == lay["dtype"] for m in metas.values()))


class _Unhashable:
    """A map with a key Python cannot hash (an array, a map): no field type takes it, but
    where the schema ignores a value (an unknown key, an extra trailing entry) it is fine."""


def _parse(data: bytes):
    """(header, containers) as the msgpack library reads it, or None if it is not valid."""
    count = [0]

    def array(items):
        count[0] += 1
        return items

    def pairs(items):
        count[0] += 1
        try:
            return dict(items)
        except TypeError:
            return _Unhashable()

    try:
        # Invalid UTF-8 in a string is kept (as surrogates): it is refused where a string
        # is read, and harmless where the schema skips the value.
        header = msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True,
                                 unicode_errors="surrogateescape", list_hook=array,
                                 object_pairs_hook=pairs)
    except Exception:
        return None
    return header, count[0]


def reference(frames: list[bytes], accepted: tuple[type, ...]) -> str:
    if not frames:
        return E.BAD_MESSAGE
    head = frames[0]
    if len(head) > P.MAX_HEADER_BYTES:
        return E.TOO_LARGE
    parsed = _parse(head)
    if parsed is None:
        return E.BAD_MESSAGE
    header, containers = parsed
    if containers > max(MIN_CONTAINERS, len(head) // BYTES_PER_CONTAINER):
        return E.TOO_LARGE
    if isinstance(header, dict):  # versions up to 4: a map with the version at "v"
        old = header.get("v")
        return (E.VERSION_MISMATCH if isinstance(old, int) and not isinstance(old, bool)
                and old != P.PROTOCOL_VERSION else E.BAD_MESSAGE)
    if not isinstance(header, list) or len(header) != 2:
        return E.BAD_MESSAGE
    version, body = header
    if not isinstance(version, int) or isinstance(version, bool):
        return E.BAD_MESSAGE
    if version != P.PROTOCOL_VERSION:
        return E.VERSION_MISMATCH
    tag = body[0] if isinstance(body, list) and body else None
    cls = P.MESSAGE_TYPES.get(tag) if _is_str(tag) else None
    if cls is None:
        return E.UNKNOWN_TYPE
    if cls not in accepted:
        return E.UNEXPECTED_TYPE
    try:
        msg = _struct(body, cls)
    except _Bad:
        return E.BAD_MESSAGE
    if tag == "kv_chunk":
        ok = _tensors_ok(msg.get("tensors", {}), frames) and _kv_chunk_ok(msg)
    else:
        ok = len(frames) == 1 and (tag != "hello" or msg["role"] in ("prefill", "decode",
                                                                      "colocated"))
    return tag if ok else E.BAD_MESSAGE
