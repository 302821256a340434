"""The fuzz tests' oracle: what docs/protocol.md says a list of frames is, written
independently of pdserve.common.protocol's decoder (the code under test).

``reference(frames, accepted)`` returns the error code the receiver must answer with,
or the tag of the message it must take. It reads only the declared schema (field names,
types and defaults of the wire classes) from the package, as data; the rules are the
document's, in its order: header size, MessagePack map, integer version equal to ours,
known tag, a type this socket takes, a `tensors` list with one frame per entry, every
field of its declared type (`int` rejects booleans, `float` accepts integers, a missing
field is an error unless it has a default, unknown keys are ignored), each tensor's
dtype x shape = nbytes = frame length, and the cross-field rules of Hello and KVChunk.
"""
from __future__ import annotations

import dataclasses
import math
import typing

import msgpack

from pdserve.common import errors as E
from pdserve.common import protocol as P

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int32": 4, "int64": 8, "uint8": 1}


def _conforms(value, tp) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        return (value is None and type(None) in args) or any(
            _conforms(value, a) for a in args if a is not type(None))
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, args[0]) for v in value)
    if dataclasses.is_dataclass(tp):
        return _fields_conform(value, tp)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {bool: bool, str: str, bytes: bytes, dict: dict}[tp])


def _fields_conform(value, cls) -> bool:
    if not isinstance(value, dict):
        return False
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name == "tensors":
            continue
        if f.name not in value:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                return False
        elif not _conforms(value[f.name], hints[f.name]):
            return False
    return True


def _tensor_ok(meta, frame: bytes) -> bool:
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
        return False
    dtype, shape, nbytes = meta.get("dtype"), meta.get("shape"), meta.get("nbytes")
    return (isinstance(dtype, str) and dtype in DTYPE_BYTES and isinstance(shape, list)
            and all(_conforms(d, int) and d >= 0 for d in shape) and _conforms(nbytes, int)
            and math.prod(shape) * DTYPE_BYTES[dtype] == nbytes == len(frame))


def _cross_fields_ok(tag: str, header: dict, metas: list) -> bool:
    if tag == "hello":
        return header["role"] in ("prefill", "decode", "colocated")
    if tag == "kv_chunk":
        lay = header["kv_layout"]
        names = [f"{kv}{i}" for i in range(header["layer_start"], header["layer_end"])
                 for kv in "kv"]
        return (lay["dtype"] in DTYPE_BYTES
                and 0 <= header["layer_start"] < header["layer_end"] <= lay["num_layers"]
                and header["num_tokens"] > 0 and lay["block_size"] > 0
                and sorted(m["name"] for m in metas) == sorted(names))
    return True


def reference(frames: list[bytes], accepted: tuple[type, ...]) -> str:
    if not frames:
        return E.BAD_MESSAGE
    if len(frames[0]) > P.MAX_HEADER_BYTES:
        return E.TOO_LARGE
    try:
        header = msgpack.unpackb(frames[0], raw=False)
    except Exception:
        return E.BAD_MESSAGE
    if not isinstance(header, dict):
        return E.BAD_MESSAGE
    version = header.get("v")
    if not isinstance(version, int) or isinstance(version, bool):
        return E.BAD_MESSAGE
    if version != P.PROTOCOL_VERSION:
        return E.VERSION_MISMATCH
    tag = header.get("t")
    cls = P.MESSAGE_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        return E.UNKNOWN_TYPE
    if cls not in accepted:
        return E.UNEXPECTED_TYPE
    metas = header.get("tensors")
    takes_tensors = any(f.name == "tensors" for f in dataclasses.fields(cls))
    if (not isinstance(metas, list) or (metas and not takes_tensors)
            or len(metas) != len(frames) - 1 or not _fields_conform(header, cls)
            or not all(_tensor_ok(m, f) for m, f in zip(metas, frames[1:]))
            or len({m["name"] for m in metas}) != len(metas)
            or not _cross_fields_ok(tag, header, metas)):
        return E.BAD_MESSAGE
    return tag
