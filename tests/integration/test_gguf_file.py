"""pdserve's GGUF header reader (model/gguf_file.py) against gguf's own GGUFReader on real
files: the bundled model and tiny checkpoints written in every weight type pdserve
loads, and a SentencePiece vocabulary. Every key's value (and its Python type), every
tensor's name, type, sizes, offset and data (dtype, shape, bytes) must be the same. Then
damaged and hostile files: each refused with a ModelLoadError saying what is wrong,
whatever count or length the file claims (checked against the file's size before any
loop over it: a test that looped would meet the suite's timeout)."""
from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from pdserve.model import gguf as pd_gguf
from pdserve.model.errors import ModelLoadError
from pdserve.model.gguf_file import GGUFFile
from tests import gguf_files


def assert_same(path) -> None:
    ours, ref = GGUFFile(str(path)), gguf.GGUFReader(str(path))
    assert list(ours.fields) == list(ref.fields)
    for key, field in ref.fields.items():
        got, want = ours.fields[key].contents(), field.contents()
        assert got == want and type(got) is type(want), key
        if isinstance(want, list) and want:
            assert {type(v) for v in got} == {type(v) for v in want}, key
        assert len(ours.fields[key].data) == len(field.data), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == \
            (b.tensor_type, b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name


def test_the_bundled_model_reads_as_gguf_reads_it():
    from pdserve.model.default_model import bundled_model

    path = bundled_model()[0]
    if path is None:
        pytest.skip("no bundled model")
    assert_same(path)


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_each_weight_type_reads_as_gguf_reads_it(tiny_model, tmp_path, qtype):
    assert_same(gguf_files.write_gguf(tiny_model("llama"), tmp_path / "m.gguf", qtype))


def test_a_sentencepiece_vocabulary_and_an_unsupported_type_read_as_gguf_reads_them(
        tiny_model, tmp_path):
    tokens, scores, types = gguf_files.sentencepiece_vocab(["hello world", "a b c"], 300)

    assert_same(gguf_files.write_gguf(tiny_model("llama"), tmp_path / "sp.gguf",
                                      add_tokenizer=gguf_files.add_sentencepiece(
                                          tokens, scores, types)))
    assert_same(gguf_files.write_unsupported(tmp_path / "iq2.gguf", "IQ2_XXS"))


def test_every_value_type_alignment_and_tensor_type_read_as_gguf_reads_them(tmp_path):
    """Keys of every scalar type (a NaN, 2**64-1, both bools), empty and non-ASCII strings,
    arrays of each kind and empty ones, an alignment of 64, tensors of every element type,
    one of no elements and a 3-D Q8_0 one; and the same file as GGUF version 2."""
    w = gguf.GGUFWriter(str(tmp_path / "all.gguf"), "llama")
    w.add_custom_alignment(64)
    T = gguf.GGUFValueType
    for i, (vtype, value) in enumerate([
            (T.UINT8, 255), (T.INT8, -128), (T.UINT16, 65535), (T.INT16, -32768),
            (T.UINT32, 2**32 - 1), (T.INT32, -2**31), (T.FLOAT32, float("nan")),
            (T.FLOAT32, 1e-5), (T.UINT64, 2**64 - 1), (T.INT64, -2**63), (T.FLOAT64, 0.1),
            (T.BOOL, True), (T.BOOL, False), (T.STRING, ""), (T.STRING, "héllo ▁ 語")]):
        w.add_key_value(f"k.{i}", value, vtype)
    w.add_array("a.str", ["", "x", "é"])
    w.add_array("a.int", [1, -2, 3])
    w.add_array("a.float", [0.5, -1.25])
    w.add_array("a.bool", [True, False])
    w.add_array("a.empty", [])
    for name, arr in [("f64", np.arange(8, dtype=np.float64)), ("i8", np.arange(8, dtype=np.int8)),
                      ("i16", np.arange(8, dtype=np.int16)), ("i32", np.arange(8, dtype=np.int32)),
                      ("i64", np.arange(8, dtype=np.int64)), ("f16", np.ones((2, 4), np.float16)),
                      ("none", np.zeros((0, 4), np.float32))]:
        w.add_tensor(name, arr)
    q8 = gguf.quants.quantize(np.ones((2, 3, 64), np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    path = tmp_path / "all.gguf"
    v2 = tmp_path / "v2.gguf"
    data = bytearray(path.read_bytes())
    data[4:8] = struct.pack("<I", 2)
    v2.write_bytes(bytes(data))
    for p in (path, v2):
        ours, ref = GGUFFile(str(p)), gguf.GGUFReader(str(p))
        assert np.isnan(ours.fields["k.6"].contents()) and np.isnan(ref.fields["k.6"].contents())
        for key in ref.fields:
            if key != "k.6":
                got, want = ours.fields[key].contents(), ref.fields[key].contents()
                assert got == want and type(got) is type(want), key
        for a, b in zip(ours.tensors, ref.tensors, strict=True):
            assert (a.name, a.tensor_type, a.data_offset, a.data.dtype, a.data.shape) == \
                (b.name, b.tensor_type, b.data_offset, b.data.dtype, b.data.shape)
            assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name


def header(kvs: bytes, n_kv: int, n_tensors: int = 0, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + kvs


def string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def kv_str(key: bytes, value: bytes) -> bytes:
    return string(key) + struct.pack("<I", gguf.GGUFValueType.STRING) + string(value)


def tensor_info(name: bytes, dims: tuple[int, ...], ttype: int, offset: int,
                bare: bool = False) -> bytes:
    """One tensor's entry (bare), or a file of it alone with 64 bytes of data."""
    info = string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) \
        + struct.pack("<IQ", ttype, offset)
    return info if bare else header(info, 0, 1) + bytes(64)


HOSTILE = {
    "no magic": (b"GGUX" + bytes(60), "no GGUF magic"),
    "version 1": (header(b"", 0, version=1), "GGUF version 1"),
    "big-endian": (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian"),
    "cut in the counts": (b"GGUF" + struct.pack("<I", 3) + b"\x01", "the file ends"),
    "a key of 2**60 bytes": (header(struct.pack("<Q", 2**60) + b"abc", 1), "runs past"),
    "a value of 2**63 bytes": (header(string(b"k") + struct.pack("<IQ", 8, 2**63), 1),
                               "runs past"),
    "2**62 keys": (header(kv_str(b"a", b"b"), 2**62), "the file ends"),
    "an array of 2**61 strings": (header(string(b"k") + struct.pack("<IIQ", 9, 8, 2**61), 1),
                                  "cannot fit"),
    "an array of 2**40 floats": (header(string(b"k") + struct.pack("<IIQ", 9, 6, 2**40), 1),
                                 "cannot fit"),
    "an unknown value type": (header(string(b"k") + struct.pack("<I", 99), 1), "99"),
    "a key twice": (header(kv_str(b"a", b"b") * 2, 2), "appears twice"),
    "a tensor past the end": (header(string(b"t") + struct.pack("<I", 2) + struct.pack(
        "<QQ", 4096, 4096) + struct.pack("<IQ", 0, 0), 0, n_tensors=1), "run past"),
    "a tensor at offset 2**64-1": (tensor_info(b"t", (4,), 0, 2**64 - 1), "run past"),
    "a tensor of an unknown type": (tensor_info(b"t", (32,), 99, 0), "type 99"),
    "a tensor name twice": (header(tensor_info(b"t", (4,), 0, 0, bare=True) * 2, 0, 2)
                            + bytes(64), "appears twice"),
    "2**62 tensors": (header(tensor_info(b"t", (4,), 0, 0, bare=True), 0, 2**62),
                      "the file ends"),
    "2**32-1 dimensions": (header(string(b"t") + struct.pack("<I", 2**32 - 1), 0, 1),
                           "dimensions"),
    "no element and a dimension of 2**63": (tensor_info(b"t", (0, 2**63), 0, 0), "tensor 't'"),
    "a row of half a block": (tensor_info(b"t", (16, 2), gguf.GGMLQuantizationType.Q4_0, 0),
                              "tensor 't'"),
    "an alignment of 3": (header(string(b"general.alignment") + struct.pack("<II", 4, 3), 1),
                          "not a power of two"),
    "an alignment of 0": (header(string(b"general.alignment") + struct.pack("<II", 4, 0), 1),
                          "not a power of two"),
    "an alignment in 64 bits": (header(string(b"general.alignment")
                                       + struct.pack("<IQ", 10, 64), 1), "not a UINT32"),
    "an array of arrays": (header(string(b"k") + struct.pack("<IIQ", 9, 9, 0), 1),
                           "array of arrays"),
    "an empty file": (b"", "empty"),
    "a tensor of 9 dimensions": (header(string(b"t") + struct.pack("<I", 9), 0, 1),
                                 "9 dimensions"),
    "half a block": (header(string(b"t") + struct.pack("<I", 1) + struct.pack("<Q", 7)
                            + struct.pack("<IQ", gguf.GGMLQuantizationType.Q4_0, 0), 0, 1)
                     + bytes(64), "not whole blocks"),
    "a bad string": (header(kv_str(b"a", b"\xff\xfe"), 1), "key 'a': the string at byte"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_damaged_or_hostile_file_is_refused_saying_what(tmp_path, case):
    data, said = HOSTILE[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file") as err:
        pd_gguf.reader(path)
    assert said in str(err.value)
