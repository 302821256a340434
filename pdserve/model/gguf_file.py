"""A GGUF file's metadata and tensor table, read for what pdserve takes from them (gguf.py,
gguf_tokenizer.py).

gguf's own ``GGUFReader`` makes two numpy arrays for every string of the file's arrays:
about 200,000 for the bundled SmolLM2's 49,152 tokens and 48,900 merges, 2.8 s of every
start of a node, of the router and of each ``pdserve model`` command on that file. This
reads the same header in one pass (``struct`` and numpy), strings straight to ``str``, and maps
each tensor's data as GGUFReader does (the same dtype and shape: the element type for
F16, F32, F64 and the integer types, the blocks' bytes for a quantized type), so the
loader and gguf's ``quants.dequantize`` read them unchanged.

Little-endian files of GGUF versions 2 and 3 (what llama.cpp writes). Refused, each with a
ValueError saying where: other versions and big-endian files (their quantized blocks would
be read as little-endian ones), arrays of arrays (pdserve reads none), strings that are
not UTF-8, and any count, length or offset that does not fit the file. Numeric arrays
stay views of the mapping until ``contents()`` asks for them.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)
from gguf.quants import quant_shape_to_byte_shape

VERSIONS = (2, 3)
# the numeric value types as numpy reads them (GGUFReader's own, so the same Python values)
_NUMERIC = {GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
           GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
           GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "<u8",
           GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8"}
_U64 = struct.Struct("<Q")
_ELEMENTS = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
             GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
             GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
             GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True, eq=False)  # (equality would compare a numeric array's elements)
class Field:
    """One key's value: a str, int, float or bool; an array of strings as a list, a numeric
    array as a view of the file's mapping."""
    name: str
    value: Any
    types: tuple[GGUFValueType, ...]  # the value's type; an array's, then its elements'

    def contents(self) -> Any:
        """The value, as GGUFReader's ``contents()`` gives it: Python values, a new list
        for an array."""
        if isinstance(self.value, np.ndarray):
            return self.value.tolist()
        return list(self.value) if isinstance(self.value, list) else self.value

    @property
    def data(self) -> range:
        """An index per element (an array's), or the one of a scalar."""
        array = isinstance(self.value, (list, np.ndarray))
        return range(len(self.value) if array else 1)


@dataclass(frozen=True, eq=False)
class Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]   # GGUF's order: the fastest-moving dimension first
    n_elements: int
    n_bytes: int
    data_offset: int         # in the file
    data: np.ndarray         # a view of the file's mapping


def value_type(raw: int, at: int) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise ValueError(f"value type {raw} at byte {at} is not one of GGUF's") from None


class _Cursor:
    """Reads values one after another from the file's bytes, each checked against its end."""

    def __init__(self, mapped: np.ndarray):
        self.mapped, self.buf, self.at = mapped, memoryview(mapped), 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.at + size > len(self.buf):
            raise ValueError(f"the file ends at byte {len(self.buf)}, inside a value at "
                             f"{self.at}")
        (v,) = struct.unpack_from("<" + fmt, self.buf, self.at)
        self.at += size
        return v

    def string(self) -> str:
        return self._strings(1)[0]

    def field(self, key: str) -> Field:
        at = self.at
        vtype = value_type(self.take("I"), at)
        if vtype == GGUFValueType.ARRAY:
            value, etype = self.array()
            return Field(key, value, (vtype, etype))
        return Field(key, self.value(vtype), (vtype,))

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        dtype = np.dtype(_NUMERIC[vtype])  # (value_type: one of GGUF's; not an array)
        if self.at + dtype.itemsize > len(self.buf):
            raise ValueError(f"the file ends at byte {len(self.buf)}, inside a value at "
                             f"{self.at}")
        v = self.mapped[self.at:self.at + dtype.itemsize].view(dtype)[0].item()
        self.at += dtype.itemsize
        return v

    def array(self) -> tuple[list | np.ndarray, GGUFValueType]:
        at = self.at
        etype = value_type(self.take("I"), at)
        n = self.take("Q")
        if etype == GGUFValueType.ARRAY:
            raise ValueError(f"an array of arrays at byte {at}: not supported")
        # every element takes its size at least (8 bytes for a string's length)
        least = 8 if etype == GGUFValueType.STRING else np.dtype(_NUMERIC[etype]).itemsize
        if n > (len(self.buf) - self.at) // least:
            raise ValueError(f"an array of {n} elements at byte {at} cannot fit the rest of "
                             "the file")
        if etype == GGUFValueType.STRING:
            return self._strings(n), etype
        out = self.mapped[self.at:self.at + n * least].view(_NUMERIC[etype])
        self.at += n * least
        return out, etype

    def _strings(self, n: int) -> list[str]:
        """n strings one after another (a vocabulary's: the loop is the parse's time)."""
        buf, at, end, length, out = self.buf, self.at, len(self.buf), _U64.unpack_from, []
        for _ in range(n):
            if at + 8 > end:
                raise ValueError(f"the file ends at byte {end}, inside a string's length")
            (k,) = length(buf, at)
            at += 8
            if k > end - at:
                raise ValueError(f"a string of {k} bytes at byte {at - 8} runs past the "
                                 f"file's end ({end})")
            try:
                out.append(str(buf[at:at + k], "utf-8"))
            except UnicodeDecodeError as exc:
                raise ValueError(f"the string at byte {at - 8} is not UTF-8 ({exc.reason} at "
                                 f"its byte {exc.start})") from None
            at += k
        self.at = at
        return out


class GGUFFile:
    """The file's ``fields`` (key -> Field, in file order, GGUF.version, GGUF.tensor_count
    and GGUF.kv_count first), ``tensors`` (in file order) and ``data`` (the whole file,
    memory-mapped read-only: the tensors' views keep it mapped)."""

    def __init__(self, path: str):
        self.data = np.memmap(path, mode="r")
        cur = _Cursor(self.data)
        if cur.take("I") != GGUF_MAGIC:
            raise ValueError("no GGUF magic at its start")
        version = cur.take("I")
        if version not in VERSIONS:
            hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
            raise ValueError(f"GGUF version {version}{hint}; pdserve reads versions "
                             f"{', '.join(map(str, VERSIONS))}, little-endian")
        tensor_count, kv_count = cur.take("Q"), cur.take("Q")
        self.fields: dict[str, Field] = {}
        for name, value, vtype in (("GGUF.version", version, GGUFValueType.UINT32),
                                   ("GGUF.tensor_count", tensor_count, GGUFValueType.UINT64),
                                   ("GGUF.kv_count", kv_count, GGUFValueType.UINT64)):
            self.fields[name] = Field(name, value, (vtype,))
        for _ in range(kv_count):
            key = cur.string()
            if key in self.fields:
                raise ValueError(f"key {key!r} appears twice")
            try:
                self.fields[key] = cur.field(key)
            except ValueError as exc:
                raise ValueError(f"key {key!r}: {exc}") from None
        infos = []
        for _ in range(tensor_count):
            name = cur.string()
            n_dims = cur.take("I")
            if n_dims > 8:
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
            dims = tuple(cur.take("Q") for _ in range(n_dims))
            raw = cur.take("I")
            try:
                ttype = GGMLQuantizationType(raw)
            except ValueError:
                raise ValueError(f"tensor {name!r}: type {raw} is not one of GGML's") from None
            infos.append((name, dims, ttype, cur.take("Q")))
        align = self.fields.get("general.alignment")
        alignment = GGUF_DEFAULT_ALIGNMENT
        if align is not None:
            if align.types != (GGUFValueType.UINT32,):
                raise ValueError(f"general.alignment is a {align.types[0].name}, not a UINT32")
            if align.value <= 0 or align.value & (align.value - 1):
                raise ValueError(f"general.alignment {align.value}: not a power of two")
            alignment = align.value
        start = -(-cur.at // alignment) * alignment
        self.tensors: list[Tensor] = []
        seen = set()
        for name, dims, ttype, offset in infos:
            if name in seen:
                raise ValueError(f"tensor {name!r} appears twice")
            seen.add(name)
            try:
                self.tensors.append(self._tensor(name, dims, ttype, start + offset))
            except ValueError as exc:  # (numpy's and gguf's shape errors too)
                raise ValueError(f"tensor {name!r}: {exc}") from None

    def _tensor(self, name: str, dims: tuple[int, ...], ttype: GGMLQuantizationType,
                at: int) -> Tensor:
        n = int(np.prod(dims, dtype=object)) if dims else 1
        block, type_size = GGML_QUANT_SIZES[ttype]
        if n % block:
            raise ValueError(f"{n} elements, not whole blocks of {block}")
        n_bytes = n // block * type_size
        if at + n_bytes > len(self.data):
            raise ValueError(f"{n_bytes} bytes at {at} run past the file's end "
                             f"({len(self.data)})")
        shape = tuple(reversed(dims))
        element = _ELEMENTS.get(ttype)
        if element is None:  # quantized: the blocks' bytes, rows of them
            raw = self.data[at:at + n_bytes]
            data = raw.reshape(quant_shape_to_byte_shape(shape, ttype))
        else:
            data = self.data[at:at + n_bytes].view(element).reshape(shape)
        return Tensor(name, ttype, dims, n, n_bytes, at, data)
