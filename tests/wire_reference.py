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
        return _kv_chunk_ok(header, metas)
    return True


def _kv_chunk_ok(header: dict, metas: list) -> bool:
    """One or more parts (requests), ids unique; each part's blocks after its first_block
    follow the previous part's in every tensor; all parts carry checksums or none do;
    first_token only on the last chunk; the pages in tensor frames or in shm, not both."""
    lay, parts = header["kv_layout"], header["parts"]
    names = [f"{kv}{i}" for i in range(header["layer_start"], header["layer_end"])
             for kv in "kv"]
    bs = lay["block_size"]
    if not (lay["dtype"] in DTYPE_BYTES and bs > 0
            and 0 <= header["layer_start"] < header["layer_end"] <= lay["num_layers"]
            and 1 <= len(parts) <= P.MAX_KV_PARTS
            and len({p["req_id"] for p in parts}) == len(parts)):
        return False
    sums = len(names) if parts[0].get("checksums") else 0
    total = 0
    for part in parts:
        blocks, first = -(-part["num_tokens"] // bs), part.get("first_block", 0)
        if (part["num_tokens"] <= 0 or not 0 <= first < blocks
                or len(part.get("checksums", [])) != sums
                or (part.get("first_token") is not None and not header["last"])):
            return False
        total += blocks - first
    shm = header.get("shm")
    if shm is not None:
        return (not metas and len(shm["offsets"]) == len(names)
                and len(shm["block_ids"]) == total
                and all(0 <= v < 2**63 for v in (*shm["offsets"], *shm["block_ids"])))
    shape = [total, bs, lay["num_kv_heads"], lay["head_dim"]]
    return (sorted(m["name"] for m in metas) == sorted(names)
            and all(m["shape"] == shape and m["dtype"] == lay["dtype"] for m in metas))


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
