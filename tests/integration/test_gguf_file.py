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


def header(kvs: bytes, n_kv: int, n_tensors: int = 0, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + kvs


def string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def kv_str(key: bytes, value: bytes) -> bytes:
    return string(key) + struct.pack("<I", gguf.GGUFValueType.STRING) + string(value)


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
        "<QQ", 4096, 4096) + struct.pack("<IQ", 0, 0), 0, n_tensors=1), "runs past"),
    "a tensor of 9 dimensions": (header(string(b"t") + struct.pack("<I", 9), 0, 1),
                                 "9 dimensions"),
    "half a block": (header(string(b"t") + struct.pack("<I", 1) + struct.pack("<Q", 7)
                            + struct.pack("<IQ", gguf.GGMLQuantizationType.Q4_0, 0), 0, 1)
                     + bytes(64), "not whole blocks"),
    "a bad string": (header(kv_str(b"a", b"\xff\xfe"), 1), "utf-8"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_damaged_or_hostile_file_is_refused_saying_what(tmp_path, case):
    data, said = HOSTILE[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file") as err:
        pd_gguf.reader(path)
    assert said in str(err.value)
