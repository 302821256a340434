"""Messages of protocol/ as frames and back: the MessagePack header (msgspec, checked in
C against the schema's types and limits), the tensors as raw frames beside it (zero-copy
both ways), their checksums, and a decoder that never trusts the peer: anything
malformed is a ``ProtocolError`` naming the field.

Header: ``[PROTOCOL_VERSION, [tag, field, ...]]``. A socket decodes with the one
``msgspec`` decoder for the union of the types it expects (``decoder_for``), in one
pass; only a header that fails is looked at again, to say why in the contract's terms
(another version, an unknown or unexpected tag, which field).

Torch is imported by the tensor functions only, when they first run: the router decodes
every control message here and never holds a tensor, so it loads no torch.
"""
from __future__ import annotations

import functools
import math
import re
import sys
import typing
import warnings
from typing import TYPE_CHECKING, Any, Literal, Optional, Sequence, Union

import msgpack
import msgspec
import xxhash

from pdserve.common.errors import (
    BAD_MESSAGE,
    TOO_LARGE,
    UNEXPECTED_TYPE,
    UNKNOWN_TYPE,
    VERSION_MISMATCH,
)
from pdserve.common.protocol import (
    DTYPES,
    MAX_HEADER_BYTES,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    FrameLike,
    KVChunk,
    Message,
    ProtocolError,
    TensorMeta,
)

if TYPE_CHECKING:
    import torch


@functools.cache
def _torch_dtypes() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    """Wire dtype names -> torch dtypes, and back (built on first use: torch is loaded
    then)."""
    import torch

    names = {name: getattr(torch, name) for name in DTYPES}
    return names, {dt: name for name, dt in names.items()}


def __getattr__(name: str):
    if name == "TORCH_DTYPES":  # codec.TORCH_DTYPES, as before, without torch at import
        return _torch_dtypes()[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# ---------------------------------------------------------------- tensors

def _as_bytes_view(frame: FrameLike) -> memoryview:
    """A flat byte view of a frame, without copying (zmq.Frame exposes .buffer)."""
    try:
        view = memoryview(getattr(frame, "buffer", frame))
    except TypeError:
        raise ProtocolError(BAD_MESSAGE, f"frame of type {type(frame).__name__} is not a "
                            "buffer") from None
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def checksum_of(buffer: Union[FrameLike, torch.Tensor]) -> int:
    """64-bit XXH3 of a frame or of a tensor's bytes (what KVChunk.checksums hold).

    XXH3 rather than crc32: about 20 GB/s against zlib.crc32's 4 on the CPUs we
    measured, so verifying every KV frame costs little of the transfer, and 64
    bits miss a corruption far less often than 32."""
    torch = sys.modules.get("torch")  # a tensor exists only once torch is loaded
    if torch is not None and isinstance(buffer, torch.Tensor):
        buffer = tensor_to_frame("", buffer)[1]
    return xxhash.xxh3_64_intdigest(_as_bytes_view(buffer))


def tensor_to_frame(name: str, tensor: torch.Tensor,
                    frame: int = 1) -> tuple[TensorMeta, memoryview]:
    """(meta, frame bytes) for one tensor travelling as frame ``frame`` after the header;
    the bytes are a view of the tensor, not a copy."""
    import torch

    _, dtype_names = _torch_dtypes()
    if not isinstance(tensor, torch.Tensor):
        raise ProtocolError(BAD_MESSAGE, f"tensor {name!r}: expected torch.Tensor, "
                            f"got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ProtocolError(BAD_MESSAGE, f"tensor {name!r} is on {tensor.device}; copy it to "
                            "the CPU before encoding")
    if tensor.dtype not in dtype_names:
        raise ProtocolError(BAD_MESSAGE, f"tensor {name!r}: dtype {tensor.dtype} is not one "
                            f"of {list(DTYPES)}")
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)  # bf16 has no numpy
    meta = TensorMeta(dtype=dtype_names[tensor.dtype], shape=list(tensor.shape), frame=frame)
    return meta, memoryview(flat.numpy())  # the view keeps the tensor alive


def frame_to_tensor(meta: TensorMeta, frame: FrameLike, name: str = "tensor") -> torch.Tensor:
    """Rebuild a tensor over the frame's memory after checking it against its meta (whose
    types the decoder has checked: a known dtype, non-negative dims)."""
    import torch

    torch_dtype = _torch_dtypes()[0][meta.dtype]
    want = math.prod(meta.shape) * torch_dtype.itemsize
    view = _as_bytes_view(frame)
    if view.nbytes != want:
        size = f"{want} bytes" if want < 2**63 else "over 2^63 bytes"
        raise ProtocolError(BAD_MESSAGE, f"tensor {name!r}: shape {meta.shape} x {meta.dtype} "
                            f"is {size}, its frame {meta.frame} has {view.nbytes}")
    if want == 0:
        return torch.empty(meta.shape, dtype=torch_dtype)
    if view.readonly:  # e.g. bytes; zmq frames are writable. Torch warns, we know.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(view, dtype=torch.uint8)
    else:
        raw = torch.frombuffer(view, dtype=torch.uint8)
    if raw.data_ptr() % torch_dtype.itemsize:
        # Small frames can sit unaligned inside ZeroMQ's receive batch; copying
        # them is cheap. Large frames get their own (aligned) allocation.
        raw = raw.clone()
    return raw.view(torch_dtype).view(meta.shape)


# ---------------------------------------------------------------- bounded decoding
# Decoded MessagePack may hold at most one container (map, array, struct) per this many
# bytes of input. An empty array is 1 byte on the wire and a 56-byte list in memory: a
# header of nothing else would grow 64x. With this bound the worst header grows about
# 16x, no more than a legitimate one (a token id: 3 bytes, 28 in memory).
BYTES_PER_CONTAINER = 4
MIN_CONTAINERS = 256
# The bytes that can open a MessagePack container: fixmap, fixarray, array16/32, map16/32.
_NOT_CONTAINER = bytes(b for b in range(256) if not (0x80 <= b <= 0x9F or 0xDC <= b <= 0xDF))


def check_expansion(data: FrameLike) -> None:
    """ProtocolError TOO_LARGE if ``data`` holds more containers than its size allows.

    The common case costs one C pass: the number of bytes that could open a container is
    an upper bound on the containers. Only when that bound is over the budget does the
    exact (slower) count run. Arrays cannot claim more entries than the input holds:
    msgspec and msgpack both check lengths against the bytes left before allocating."""
    size = len(data) if isinstance(data, bytes) else _as_bytes_view(data).nbytes
    budget = max(MIN_CONTAINERS, size // BYTES_PER_CONTAINER)
    if size <= budget:
        return
    raw = data if isinstance(data, bytes) else _as_bytes_view(data).tobytes()
    if len(raw.translate(None, _NOT_CONTAINER)) <= budget:
        return
    left = [budget]

    def count(obj):
        left[0] -= 1
        if left[0] < 0:
            raise ProtocolError(TOO_LARGE, f"a {size}-byte MessagePack value holds more "
                                f"than one map or array per {BYTES_PER_CONTAINER} bytes")
        return obj

    try:  # maps stay lists of pairs: any key is fine here, the typed decoder judges them
        msgpack.unpackb(raw, raw=True, strict_map_key=False, list_hook=count,
                        object_pairs_hook=count)
    except ProtocolError:
        raise
    except Exception:
        pass  # not valid MessagePack: the typed decoder says so, with the position


# ---------------------------------------------------------------- errors, in field names

_AT = re.compile(r"^(.*?)(?: - at (?:`key` in )?`\$(.*)`)?$", re.S)
_STEP = re.compile(r"\[(\d+|\.\.\.)\]|\.(\w+)")
_SHORT = re.compile(r"array` of (?:at least )?length (\d+), got (\d+)")


def _inner(tp: Any) -> Any:
    """The struct, list or dict inside Annotated / Optional wrappers."""
    while True:
        if typing.get_origin(tp) is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif typing.get_origin(tp) is Union:
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        else:
            return tp


def field_path(cls: type, path: str, error: str = "") -> str:
    """msgspec's ``[1][3][0]`` (array-like structs have no names on the wire) as
    ``TokenBatch.items[3].token_ids[0]``, walking the schema from ``cls``; a too-short
    array (``error``) names the first missing field."""
    out, tp, tagged = cls.__name__, cls, True
    for index, name in _STEP.findall(path):
        tp = _inner(tp)
        if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
            hints = typing.get_type_hints(tp, include_extras=True)
            if name:
                field = name
            else:
                i = int(index) - (1 if tagged else 0)
                if i < 0:
                    return out + ".<tag>"
                field = tp.__struct_fields__[i]
            out, tp = f"{out}.{field}", hints[field]
        elif typing.get_origin(tp) in (list, tuple):
            out, tp = f"{out}[{index}]", typing.get_args(tp)[0]
        elif typing.get_origin(tp) is dict:
            out, tp = f"{out}[{index}]", typing.get_args(tp)[1]
        tagged = False
    short = _SHORT.search(error)
    tp = _inner(tp)
    if short and isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        got = int(short.group(2)) - (1 if tagged else 0)
        missing = [f.name for f in msgspec.structs.fields(tp)[max(got, 0):] if f.required]
        if missing:
            return f"{out}.{missing[0]}: missing field"
    return out


_PROBE = msgspec.msgpack.Decoder(list[msgspec.Raw])  # an array, its entries left unread
_OLD_PROBE = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])


def _old_version(head: memoryview) -> Optional[int]:
    """The "v" of a version <= 4 header (a map), so that peer hears version_mismatch."""
    try:
        version = msgspec.msgpack.decode(_OLD_PROBE.decode(head)["v"])
    except (msgspec.ValidationError, msgspec.DecodeError, KeyError):
        return None
    return version if isinstance(version, int) and not isinstance(version, bool) else None


def _explain(head: memoryview, error: Exception, expected: Optional[tuple]) -> ProtocolError:
    """Why a header failed the typed decoder, in the contract's terms (its slow path).
    Only the version and the tag are decoded; the rest is skipped as msgspec skips it."""
    header = version = body = None
    try:
        header = _PROBE.decode(head)
        version = msgspec.msgpack.decode(header[0]) if len(header) == 2 else None
        body = _PROBE.decode(header[1]) if len(header) == 2 else None
    except msgspec.ValidationError:  # not an array: an old peer's map header, or noise
        old = _old_version(head)
        if old is not None and old != PROTOCOL_VERSION:
            return ProtocolError(VERSION_MISMATCH, f"peer speaks protocol version {old}, "
                                 f"this process speaks version {PROTOCOL_VERSION}; upgrade "
                                 "one side")
    except msgspec.DecodeError as e:
        return ProtocolError(BAD_MESSAGE, f"header is not valid MessagePack ({e})")
    if not isinstance(header, list) or len(header) != 2:
        return ProtocolError(BAD_MESSAGE, "header is not the array [version, message]")
    if not isinstance(version, int) or isinstance(version, bool):
        return ProtocolError(BAD_MESSAGE, f"header has no protocol version (got "
                             f"{str(version)[:100]})")
    if version != PROTOCOL_VERSION:
        return ProtocolError(VERSION_MISMATCH, f"peer speaks protocol version {version}, this "
                             f"process speaks version {PROTOCOL_VERSION}; upgrade one side")
    try:
        tag = msgspec.msgpack.decode(body[0]) if body else None
    except msgspec.DecodeError:  # e.g. not UTF-8: no tag this version knows
        tag = None
    cls = MESSAGE_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        return ProtocolError(UNKNOWN_TYPE, f"unknown message type {str(tag)[:100]!r}; known "
                             f"types: {', '.join(MESSAGE_TYPES)}")
    if expected is not None and cls not in expected:
        return ProtocolError(UNEXPECTED_TYPE, f"unexpected message type {cls.__name__} on "
                             f"this socket, expected one of "
                             f"{', '.join(c.__name__ for c in expected)}")
    what, path = _AT.match(str(error)).groups()
    what = what[:1].lower() + what[1:]
    return ProtocolError(BAD_MESSAGE, f"{field_path(cls, (path or '')[3:], what)}: {what}"[:500])


# ---------------------------------------------------------------- codec

_ENCODER = msgspec.msgpack.Encoder()


@functools.lru_cache(maxsize=64)
def decoder_for(expected: Optional[tuple] = None) -> msgspec.msgpack.Decoder:
    """The one decoder of a socket that takes ``expected`` (None: every type)."""
    types = tuple(MESSAGE_TYPES.values()) if expected is None else expected
    assert all(MESSAGE_TYPES.get(getattr(t, "TAG", None)) is t for t in types), types
    return msgspec.msgpack.Decoder(tuple[Literal[PROTOCOL_VERSION], Union[types]])


def encode(msg: Message) -> list[Union[bytes, memoryview]]:
    """``[header, *tensor_frames]``; tensor frames are views (keep the tensors unchanged
    until ZeroMQ is done with them). Field types are the receiver's to check (msgspec
    checks them as it decodes); the cross-field rules and the sizes are checked here."""
    cls = type(msg)
    if MESSAGE_TYPES.get(getattr(cls, "TAG", None)) is not cls:
        raise ProtocolError(BAD_MESSAGE, f"{cls.__name__} is not a registered message type")
    msg._validate()
    frames: list = []
    if cls is KVChunk and msg.tensors:
        metas = {}
        for name, tensor in msg.tensors.items():
            metas[name], frame = tensor_to_frame(name, tensor, len(frames) + 1)
            frames.append(frame)
        msg = msgspec.structs.replace(msg, tensors=metas)
    try:
        packed = _ENCODER.encode((PROTOCOL_VERSION, msg))
    except (TypeError, ValueError, OverflowError) as e:  # e.g. an int over 64 bits
        raise ProtocolError(BAD_MESSAGE, f"{cls.__name__}: cannot pack header ({e})") from None
    if len(packed) > MAX_HEADER_BYTES:
        raise ProtocolError(TOO_LARGE, f"{cls.__name__} header is {len(packed)} bytes, over "
                            f"MAX_HEADER_BYTES={MAX_HEADER_BYTES}; send fewer items per message")
    return [packed, *frames]


def decode(frames: Sequence[FrameLike], expected: Optional[tuple[type, ...]] = None) -> Message:
    """Rebuild a message from its frames (tensors zero-copy over the frame buffers).

    Raises ProtocolError, and only ProtocolError, for anything not in the contract
    or, when ``expected`` is given, for a type this socket does not take.
    """
    try:
        return _decode(frames, expected)
    except ProtocolError:
        raise
    except Exception as e:  # a hostile peer must not find another exception type
        raise ProtocolError(BAD_MESSAGE, f"malformed message ({type(e).__name__}: "
                            f"{str(e)[:200]})") from e


def _decode(frames: Sequence[FrameLike], expected: Optional[tuple[type, ...]]) -> Message:
    if len(frames) == 0:
        raise ProtocolError(BAD_MESSAGE, "empty message: no header frame")
    head = _as_bytes_view(frames[0])
    if head.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(TOO_LARGE, f"header is {head.nbytes} bytes, over "
                            f"MAX_HEADER_BYTES={MAX_HEADER_BYTES}")
    try:
        check_expansion(head)
        msg = decoder_for(None if expected is None else tuple(expected)).decode(head)[1]
    except ProtocolError:
        raise
    except (msgspec.ValidationError, msgspec.DecodeError) as e:  # e.g. a tag not in UTF-8
        raise _explain(head, e, expected) from None
    except Exception as e:
        raise ProtocolError(BAD_MESSAGE, f"header is not valid MessagePack ({type(e).__name__}: "
                            f"{str(e)[:200]})") from None
    if type(msg) is KVChunk:
        msg = _with_tensors(msg, frames)
    elif len(frames) > 1:
        raise ProtocolError(BAD_MESSAGE, f"{type(msg).__name__} carries no tensors but "
                            f"{len(frames) - 1} frame(s) followed its header")
    msg._validate()
    return msg


def _with_tensors(msg: KVChunk, frames: Sequence[FrameLike]) -> KVChunk:
    """The chunk with its tensor metas replaced by tensors over their frames."""
    metas = msg.tensors
    if len(frames) - 1 != len(metas):
        raise ProtocolError(BAD_MESSAGE, f"KVChunk header declares {len(metas)} tensor "
                            f"frame(s) but {len(frames) - 1} followed")
    if sorted(m.frame for m in metas.values()) != list(range(1, len(frames))):
        raise ProtocolError(BAD_MESSAGE, f"KVChunk.tensors: frame indices "
                            f"{[m.frame for m in metas.values()]} are not 1..{len(metas)}, "
                            "each once")
    tensors = {name: frame_to_tensor(meta, frames[meta.frame], name)
               for name, meta in metas.items()}
    return msgspec.structs.replace(msg, tensors=tensors)
