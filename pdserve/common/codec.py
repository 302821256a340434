"""Messages of protocol.py as frames and back: the MessagePack header, the tensors as
raw frames beside it (zero-copy both ways), their checksums, and a decoder that checks
every field against the schema and never trusts the peer (anything malformed is a
``ProtocolError`` naming the field).
"""
import dataclasses
import math
import typing
import warnings
from typing import Any, Optional, Sequence, Union

import msgpack
import torch
import xxhash

from pdserve.common.errors import (
    BAD_MESSAGE,
    TOO_LARGE,
    UNEXPECTED_TYPE,
    UNKNOWN_TYPE,
    VERSION_MISMATCH,
)
from pdserve.common.protocol import (
    _DTYPE_NAMES,
    DTYPES,
    MAX_HEADER_BYTES,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    FrameLike,
    Message,
    ProtocolError,
)

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

# Decoded MessagePack may hold at most one container (map or array) per this many bytes of
# input: a header of empty maps ({} is 1 byte, a dict 64) cannot grow 70x in memory.
BYTES_PER_CONTAINER = 16
MIN_CONTAINERS = 256


def checksum_of(buffer: Union[FrameLike, torch.Tensor]) -> int:
    """64-bit XXH3 of a frame or of a tensor's bytes (what KVPart.checksums hold).

    XXH3 rather than crc32: about 20 GB/s against zlib.crc32's 4 on the CPUs we
    measured, so verifying every KV frame costs little of the transfer, and 64
    bits miss a corruption far less often than 32."""
    if isinstance(buffer, torch.Tensor):
        buffer = tensor_to_frame("", buffer)[1]
    return xxhash.xxh3_64_intdigest(_as_bytes_view(buffer))


def tensor_to_frame(name: str, tensor: torch.Tensor) -> tuple[dict, memoryview]:
    """(meta, frame) for one tensor; the frame is a view of the tensor, not a copy."""
    if not isinstance(tensor, torch.Tensor):
        raise ProtocolError(BAD_MESSAGE, f"tensor {name!r}: expected torch.Tensor, "
                            f"got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ProtocolError(BAD_MESSAGE, f"tensor {name!r} is on {tensor.device}; copy it to "
                            "the CPU before encoding")
    if tensor.dtype not in _DTYPE_NAMES:
        raise ProtocolError(BAD_MESSAGE, f"tensor {name!r}: dtype {tensor.dtype} is not one "
                            f"of {list(DTYPES)}")
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)  # bf16 has no numpy
    meta = {"name": name, "dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
            "nbytes": flat.numel()}
    return meta, memoryview(flat.numpy())  # the view keeps the tensor alive


def frame_to_tensor(meta: Any, frame: FrameLike, index: int = 0) -> torch.Tensor:
    """Rebuild a tensor over the frame's memory after checking it against its meta."""
    where = f"tensor {index}"
    if not isinstance(meta, dict):
        raise ProtocolError(BAD_MESSAGE, f"{where}: meta is a {type(meta).__name__}, "
                            "expected a map")
    name, dtype, shape, nbytes = (meta.get(k) for k in ("name", "dtype", "shape", "nbytes"))
    if not isinstance(name, str):
        raise ProtocolError(BAD_MESSAGE, f"{where}: meta.name must be a str")
    where = f"tensor {name!r}"
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ProtocolError(BAD_MESSAGE, f"{where}: dtype {dtype!r} is not one of {list(DTYPES)}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise ProtocolError(BAD_MESSAGE, f"{where}: shape {shape!r} is not a list of "
                            "non-negative ints")
    if not _is_int(nbytes) or nbytes < 0:
        raise ProtocolError(BAD_MESSAGE, f"{where}: nbytes {nbytes!r} is not a non-negative int")
    torch_dtype = DTYPES[dtype]
    want = math.prod(shape) * torch_dtype.itemsize
    if want != nbytes:
        raise ProtocolError(BAD_MESSAGE, f"{where}: shape {shape} x {dtype} is {want} bytes "
                            f"but the header says nbytes={nbytes}")
    view = _as_bytes_view(frame)
    if view.nbytes != nbytes:
        raise ProtocolError(BAD_MESSAGE, f"{where}: frame has {view.nbytes} bytes, header "
                            f"says nbytes={nbytes}")
    if nbytes == 0:
        return torch.empty(shape, dtype=torch_dtype)
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
    return raw.view(torch_dtype).view(shape)


# ---------------------------------------------------------------- field types

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_SCALARS = {
    int: _is_int,
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    bool: lambda v: isinstance(v, bool),
    str: lambda v: isinstance(v, str),
    bytes: lambda v: isinstance(v, (bytes, bytearray)),
    dict: lambda v: isinstance(v, dict),
}


_EXACT = {int: {int}, str: {str}, bool: {bool}, bytes: {bytes}}


def _type_name(tp: Any) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is Union:
        return " or ".join("None" if a is type(None) else _type_name(a) for a in args)
    if typing.get_origin(tp) is list:
        return f"list[{_type_name(args[0])}]"
    return getattr(tp, "__name__", str(tp))


def _fail(path: str, tp: Any, value: Any) -> typing.NoReturn:
    raise ProtocolError(BAD_MESSAGE, f"{path}: expected {_type_name(tp)}, "
                        f"got {type(value).__name__}")


_FIELDS: dict[type, tuple] = {}


def _fields_of(cls: type) -> tuple:
    """(name, type, has_default) of a wire dataclass's fields, tensors excluded."""
    if cls not in _FIELDS:
        hints = typing.get_type_hints(cls)
        _FIELDS[cls] = tuple(
            (f.name, hints[f.name], f.default is not dataclasses.MISSING
             or f.default_factory is not dataclasses.MISSING)
            for f in dataclasses.fields(cls) if f.name != "tensors")
    return _FIELDS[cls]


def _convert(value: Any, tp: Any, path: str, out: bool) -> Any:
    """Check value against tp; out=True: dataclass -> map, out=False: map -> dataclass."""
    origin = typing.get_origin(tp)
    if origin is Union:
        if value is None:
            if type(None) in typing.get_args(tp):
                return None
            _fail(path, tp, value)
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _convert(value, inner, path, out)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            _fail(path, tp, value)
        (item,) = typing.get_args(tp)
        if item in _EXACT and set(map(type, value)) <= _EXACT[item]:
            return list(value)  # fast path (C speed) for token id lists
        return [_convert(v, item, f"{path}[{i}]", out) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if out:
            if not isinstance(value, tp):
                _fail(path, tp, value)
            return {name: _convert(getattr(value, name), hint, f"{path}.{name}", True)
                    for name, hint, _ in _fields_of(tp)}
        if not isinstance(value, dict):
            _fail(path, tp, value)
        kwargs = {}
        for name, hint, has_default in _fields_of(tp):
            if name in value:
                kwargs[name] = _convert(value[name], hint, f"{path}.{name}", False)
            elif not has_default:
                raise ProtocolError(BAD_MESSAGE, f"{path}.{name}: missing field "
                                    f"(expected {_type_name(hint)})")
        return tp(**kwargs)
    check = _SCALARS.get(tp)
    if check is None:
        raise TypeError(f"protocol: unsupported field type {tp!r} at {path}")
    if not check(value):
        _fail(path, tp, value)
    return float(value) if tp is float else value


# ---------------------------------------------------------------- codec

def encode(msg: Message) -> list[Union[bytes, memoryview]]:
    """``[header, *tensor_frames]``; tensor frames are views (keep the tensors unchanged
    until ZeroMQ is done with them)."""
    cls = type(msg)
    if MESSAGE_TYPES.get(getattr(cls, "TAG", None)) is not cls:
        raise ProtocolError(BAD_MESSAGE, f"{cls.__name__} is not a registered message type")
    header = {"v": PROTOCOL_VERSION, "t": cls.TAG}
    header.update(_convert(msg, cls, cls.__name__, out=True))
    msg._validate()
    metas, frames = [], []
    for name, tensor in getattr(msg, "tensors", {}).items():
        meta, frame = tensor_to_frame(name, tensor)
        metas.append(meta)
        frames.append(frame)
    header["tensors"] = metas
    try:
        packed = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:  # e.g. an int over 64 bits
        raise ProtocolError(BAD_MESSAGE, f"{cls.__name__}: cannot pack header ({e})") from None
    if len(packed) > MAX_HEADER_BYTES:
        raise ProtocolError(TOO_LARGE, f"{cls.__name__} header is {len(packed)} bytes, over "
                            f"MAX_HEADER_BYTES={MAX_HEADER_BYTES}; send fewer items per message")
    return [packed, *frames]


def unpack_bounded(data) -> Any:
    """msgpack.unpackb with a bound on how far the result may outgrow ``data``: at most one
    map or array per BYTES_PER_CONTAINER bytes (ProtocolError TOO_LARGE past it); strings,
    bins and arrays cannot be longer than the input either (msgpack's own limits)."""
    budget = [max(MIN_CONTAINERS, len(data) // BYTES_PER_CONTAINER)]

    def count(obj):
        budget[0] -= 1
        if budget[0] < 0:
            raise ProtocolError(TOO_LARGE, f"a {len(data)}-byte MessagePack value holds more "
                                f"than one map or array per {BYTES_PER_CONTAINER} bytes")
        return obj

    return msgpack.unpackb(data, raw=False, list_hook=count, object_hook=count)


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
        header = unpack_bounded(head)
    except ProtocolError:
        raise
    except Exception as e:
        raise ProtocolError(BAD_MESSAGE, f"header is not valid MessagePack ({type(e).__name__}: "
                            f"{str(e)[:200]})") from None
    if not isinstance(header, dict):
        raise ProtocolError(BAD_MESSAGE, f"header is a {type(header).__name__}, expected a map")
    version = header.get("v")
    if not _is_int(version):
        raise ProtocolError(BAD_MESSAGE, f"header has no protocol version 'v' (got {version!r})")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(VERSION_MISMATCH, f"peer speaks protocol version {version}, this "
                            f"process speaks version {PROTOCOL_VERSION}; upgrade one side")
    tag = header.get("t")
    cls = MESSAGE_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ProtocolError(UNKNOWN_TYPE, f"unknown message type {tag!r}; known types: "
                            f"{', '.join(MESSAGE_TYPES)}")
    if expected is not None and cls not in expected:
        raise ProtocolError(UNEXPECTED_TYPE, f"unexpected message type {cls.__name__} on this "
                            f"socket, expected one of {', '.join(c.__name__ for c in expected)}")
    metas = header.get("tensors")
    if not isinstance(metas, list):
        raise ProtocolError(BAD_MESSAGE, f"{cls.__name__}: header 'tensors' must be a list, "
                            f"got {type(metas).__name__}")
    takes_tensors = any(f.name == "tensors" for f in dataclasses.fields(cls))
    if metas and not takes_tensors:
        raise ProtocolError(BAD_MESSAGE, f"{cls.__name__} carries no tensors but the header "
                            f"declares {len(metas)}")
    if len(frames) - 1 != len(metas):
        raise ProtocolError(BAD_MESSAGE, f"{cls.__name__} header declares {len(metas)} tensor "
                            f"frame(s) but {len(frames) - 1} followed")
    msg = _convert(header, cls, cls.__name__, out=False)
    if takes_tensors:
        tensors = {}
        for i, (meta, frame) in enumerate(zip(metas, frames[1:])):
            tensor = frame_to_tensor(meta, frame, i)
            if meta["name"] in tensors:
                raise ProtocolError(BAD_MESSAGE, f"{cls.__name__}: tensor {meta['name']!r} "
                                    "appears twice")
            tensors[meta["name"]] = tensor
        msg = dataclasses.replace(msg, tensors=tensors)
    msg._validate()
    return msg
