"""FastGGUFReader parses the fields and tensors gguf-py's GGUFReader parses,
part for part: every value type, arrays of each (nested, strings with
multi-byte characters; gguf-py writes no empty array), both byte orders, and the default model's file."""

import gguf
import numpy as np
import pytest
from gguf import GGUFEndian, GGUFValueType

from tgi_server.weights.gguf_reader import FastGGUFReader
from tgi_server.weights.resolve import default_model_path

T = GGUFValueType


def assert_same(path):
    want, got = gguf.GGUFReader(path), FastGGUFReader(path)
    assert list(got.fields) == list(want.fields)
    for name, w in want.fields.items():
        g = got.fields[name]
        assert (g.offset, g.name, g.data, g.types) == (w.offset, w.name, w.data, w.types), name
        assert len(g.parts) == len(w.parts), name
        for a, b in zip(g.parts, w.parts):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), name
        assert g.contents() == w.contents(), name
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in got.tensors] == \
        [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in want.tensors]
    for a, b in zip(got.tensors, want.tensors):
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data))
    return got


def every_type(path, endianess=GGUFEndian.LITTLE):
    writer = gguf.GGUFWriter(path, "llama", endianess=endianess)
    scalars = {T.UINT8: 200, T.INT8: -100, T.UINT16: 60000, T.INT16: -30000, T.UINT32: 4_000_000_000,
               T.INT32: -2_000_000_000, T.FLOAT32: 1.5, T.UINT64: 2**63 + 5, T.INT64: -2**62,
               T.FLOAT64: 0.1, T.BOOL: True, T.STRING: "héllo ✓"}
    for kind, value in scalars.items():
        writer.add_key_value(f"test.{kind.name}", value, kind)
        if kind != T.STRING:
            writer.add_key_value(f"test.array.{kind.name}", [value] * 3, T.ARRAY, sub_type=kind)
    writer.add_key_value("test.array.strings", ["", "a", "日本語", "x" * 300], T.ARRAY, sub_type=T.STRING)
    writer.add_key_value("test.array.nested", [[1, 2], [3]], T.ARRAY, sub_type=T.ARRAY)
    writer.add_tensor("a.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("b.weight", np.ones(32, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("endianess", [GGUFEndian.LITTLE, GGUFEndian.BIG], ids=["little", "big"])
def test_every_value_type_parses_part_for_part_as_gguf_reader(tmp_path, endianess):
    reader = assert_same(every_type(tmp_path / "t.gguf", endianess))
    assert reader.fields["test.array.strings"].contents() == ["", "a", "日本語", "x" * 300]
    assert reader.fields["test.array.INT32"].contents() == [-2_000_000_000] * 3


def test_the_default_models_vocabulary_parses_as_gguf_reader():
    tokens = assert_same(default_model_path()).fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == 49152


def test_a_string_array_cut_short_raises(tmp_path):
    path = every_type(tmp_path / "t.gguf")
    data = path.read_bytes()
    cut = data.index("x".encode() * 300) + 100  # inside the last string of test.array.strings
    path.write_bytes(data[:cut])
    with pytest.raises(ValueError, match="past the file's end"):
        FastGGUFReader(path)
