"""FastGGUFReader: gguf-py's GGUFReader, the same fields and tensors, parsed
in a fraction of the time.

GGUFReader parses an array field element by element, through numpy.memmap
slices (whose Python hooks run on every slice) and a recursive call per
element, which for a vocabulary's arrays (tokens, scores, token types)
costs seconds at every shard start (figures: docs/tuning.md#gguf-reader).
This reader reads a plain-ndarray view of the map, and parses arrays of
scalars in one view and arrays of strings in one pass over the bytes,
building each element's parts as GGUFReader does (one [1] array per scalar;
a [1] uint64 length and its uint8 bytes per string), so that code written
against ReaderField (ours, transformers' GGUF loader) reads the same values.
Arrays of arrays keep GGUFReader's own path.

`dequantize` is gguf-py's, the same values to the bit, over chunks of ~64k
values instead of gguf-py's groups of 16 rows (a few hundred blocks each,
so that its per-call numpy overhead is most of the time): half the time for
SmolLM2's and Gemma 3's files (docs/tuning.md#gguf-reader)."""

from __future__ import annotations

import struct
import sys
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf import quants as gguf_quants

# values dequantized a call: gguf-py's per-call overhead amortized, the
# temporaries (a few arrays of the chunk's size) still in cache
DEQUANTIZE_CHUNK = 1 << 16


class FastGGUFReader(GGUFReader):
    """GGUFReader(path, mode) with the same `fields` and `tensors`. A file
    whose array runs past its end raises ValueError."""

    @property
    def data(self) -> np.ndarray:
        return self._mapped

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._mapped = value.view(np.ndarray)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[np.ndarray], list[int],
                                                                        list[GGUFValueType]]:
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, count, offs = GGUFValueType(raw_itype[0]), int(alen[0]), orig_offs + 12
        head: list[np.ndarray] = [raw_itype, alen]
        if itype == GGUFValueType.STRING:
            parts, size = self._strings(offs, count)
        elif (scalar := self.gguf_scalar_to_np.get(itype)) is not None:
            values = self._get(offs, scalar, count)
            if len(values) != count:
                raise ValueError(f"array of {count} {itype.name} at offset {orig_offs} runs past the file's end")
            parts, size = [values[i:i + 1] for i in range(count)], int(values.nbytes)
        else:  # nested arrays: rare and small
            return super()._get_field_parts(orig_offs, raw_type)
        # a string's bytes are its second part; a scalar is its only one
        data = list(range(3, 2 + len(parts), 2)) if itype == GGUFValueType.STRING else list(range(2, 2 + count))
        types = [GGUFValueType.ARRAY] + ([itype] if count else [])  # as GGUFReader: from its first element
        return offs + size - orig_offs, head + parts, data, types

    def _strings(self, offs: int, count: int) -> tuple[list[np.ndarray], int]:
        """`count` strings from offs: ([length [1] uint64, bytes [n] uint8] per
        string, their size in bytes)."""
        buf, start = self.data, offs
        u64 = np.dtype(np.uint64).newbyteorder(self.byte_order)
        swapped = self.byte_order == "S"
        length = struct.Struct((">" if (sys.byteorder == "little") == swapped else "<") + "Q").unpack_from
        raw = memoryview(buf)
        parts: list[Any] = []
        for _ in range(count):
            end = offs + 8 + (length(raw, offs)[0] if offs + 8 <= len(buf) else len(buf))
            if end > len(buf):
                raise ValueError(f"string at offset {offs} runs past the file's end")
            parts.append(buf[offs:offs + 8].view(u64))
            parts.append(buf[offs + 8:end])
            offs = end
        return parts, offs - start


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType, chunk: int = DEQUANTIZE_CHUNK) -> np.ndarray:
    """gguf.quants.dequantize(data, qtype): float32 values, the stored rows'
    shape with each row's bytes become its values; whole rows of about
    `chunk` values a call to the type's own block decoder (the blocks are
    independent, so the values are gguf-py's to the bit)."""
    traits = gguf_quants._type_traits.get(qtype)
    if traits is None:  # F32, F16 (views, casts) or a type gguf-py cannot read: its own path
        return gguf_quants.dequantize(data, qtype)
    traits.init_grid()
    shape = gguf_quants.quant_shape_from_byte_shape(data.shape, qtype)
    rows = data.reshape(-1, data.shape[-1])
    out = np.empty((rows.shape[0], shape[-1]), dtype=np.float32)
    step = max(1, chunk // max(1, shape[-1]))
    for start in range(0, rows.shape[0], step):
        out[start:start + step] = traits.dequantize_rows(rows[start:start + step])
    return out.reshape(shape)
