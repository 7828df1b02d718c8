"""GGUF checkpoints (llama.cpp's single-file format) in Hugging Face terms.

`GGUFFile` opens a GGUF file of a family we serve (llama, mistral, qwen2,
qwen3, gemma2, gemma3, phi3, and the mixture-of-experts mixtral, qwen2moe and
qwen3moe) and names its tensors as `transformers`' model class for it does
(gguf_names), with a config.json-equivalent dict (gguf_config); it
dequantizes a tensor when asked for it. `load_gguf` dequantizes them all.
llama.cpp's converter interleaves the rows of q_proj and k_proj of llama
models for its rotary kernel; the loader undoes that, so the tensors drop into
HF-layout model code (rotate-half RoPE) unchanged. For Gemma it stores each
RMSNorm's 1 + w; the loader gives back w, as transformers' GGUF loader does.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from .errors import CheckpointError
from .gguf_chat import FALLBACKS
from .gguf_config import ROPE_FACTORS, ROPE_FREQS, SUPPORTED_ARCHITECTURES, field, gguf_config
from .gguf_names import Part, check_shapes, hf_parts
from .gguf_reader import FastGGUFReader, dequantize

# model types whose q/k rows llama.cpp's converter permuted (LlamaModel.permute)
_PERMUTED = ("llama", "mistral", "mixtral")
# model types whose norm weights llama.cpp stores as 1 + w
_NORMS_PLUS_ONE = ("gemma2", "gemma3_text")


@dataclass(frozen=True)
class GGUFCheckpoint:
    """A GGUF file's model in Hugging Face terms.

    config: a config.json-equivalent dict (gguf_config: model_type, sizes,
        rope_theta, rope_scaling (None or an HF-style dict), tie_word_embeddings,
        bos/eos ids, sliding_window, attention_bias, and each family's own).
    tensors: HF parameter names -> dequantized tensors in the requested dtype,
        linears as [out_features, in_features]; no "lm_head.weight" when the
        embeddings are tied.
    """

    config: dict
    tensors: dict[str, torch.Tensor]


class GGUFFile:
    """An opened GGUF file in Hugging Face terms, its tensors dequantized one
    at a time on request (a shard keeps only its slice of each).

    Opening reads the metadata and checks every tensor's name and shape, so a
    file that cannot be served fails before any dequantization.
    `config` is as in GGUFCheckpoint; `names` are the HF tensor names."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        reader = _open(self.path)
        arch = _architecture(reader, self.path)
        shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}  # numpy/HF order
        self.config = gguf_config(reader, arch, shapes, self.path)
        model_type = self.config["model_type"]
        self._tensors = {t.name: t for t in reader.tensors}
        self._parts: dict[str, Part] = {}  # HF name -> where it lies in the file
        for name, shape in shapes.items():
            if name != ROPE_FREQS and name not in ROPE_FACTORS:
                self._parts.update(hf_parts(name, shape, model_type, self.path))
        self._norms_plus_one = model_type in _NORMS_PLUS_ONE
        check_shapes({name: part.shape for name, part in self._parts.items()}, self.config, self.path)

    @property
    def names(self) -> list[str]:
        return list(self._parts)

    def tensor(self, name: str) -> np.ndarray:
        """Tensor `name` dequantized to float32 in its HF shape and row order; KeyError if absent."""
        part = self._parts[name]
        tensor = self._tensors[part.gguf]
        try:
            array = dequantize(self._stored(part), GGMLQuantizationType(tensor.tensor_type))
        except NotImplementedError:
            raise CheckpointError(
                f"{self.path}: tensor {tensor.name} has unsupported type {tensor.tensor_type.name}"
            ) from None
        array = np.asarray(array, dtype=np.float32).reshape(part.shape)  # [out, in] for linears
        if self._norms_plus_one and part.kind.endswith("norm"):
            array = array - np.float32(1)
        order = self._row_order(name)
        return array if order is None else array[order]

    def blocks(self, name: str) -> tuple[np.ndarray, GGMLQuantizationType, np.ndarray | None]:
        """Tensor `name` as stored: (bytes [rows, bytes per row] uint8, block
        type, the row order giving HF's rows or None); KeyError if absent."""
        part = self._parts[name]
        kind = GGMLQuantizationType(self._tensors[part.gguf].tensor_type)
        return self._stored(part), kind, self._row_order(name)

    def _stored(self, part: Part) -> np.ndarray:
        """The part's rows as stored (quantized: [rows, bytes per row] uint8)."""
        data = np.asarray(self._tensors[part.gguf].data)
        if part.rows is None:
            return data
        return data.reshape(-1, data.shape[-1])[part.rows[0]:part.rows[1]]

    def _row_order(self, name: str) -> np.ndarray | None:
        part = self._parts[name]
        if self.config["model_type"] not in _PERMUTED or part.kind not in ("attn_q", "attn_k"):
            return None
        heads = self.config["num_attention_heads" if part.kind == "attn_q" else "num_key_value_heads"]
        return _unpermute_rotary(np.arange(part.shape[0]), heads)


def load_gguf(path: str | os.PathLike, dtype: torch.dtype) -> GGUFCheckpoint:
    """Read, dequantize and rename the whole GGUF file at `path`; CheckpointError if it cannot be served."""
    file = GGUFFile(path)
    return GGUFCheckpoint(config=file.config, tensors={name: _owned(file.tensor(name), dtype) for name in file.names})


def _owned(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """`array` as a tensor of its own in `dtype`: a dequantized array (new,
    writable) is taken over without a copy when `dtype` is float32; one that
    views the read-only map (an F32 tensor as stored) is copied."""
    if array.flags.writeable and array.flags.c_contiguous:
        return torch.from_numpy(array).to(dtype)
    return torch.tensor(array, dtype=dtype)


def load_gguf_tokenizer(path: str | os.PathLike):
    """The file's tokenizer (a PreTrainedTokenizerFast) with its vocab, special tokens and chat_template."""
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    arch = _architecture(_open(path), path)
    try:
        # Not AutoTokenizer: it also parses the whole file into a config first, many times slower
        # (figures: docs/tuning.md#gguf-reader).
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as err:  # transformers raises many types for a vocabulary it cannot convert
        raise CheckpointError(f"{path}: cannot build the tokenizer ({_one_line(err)})") from None
    if tokenizer.chat_template is None and arch in FALLBACKS:
        tokenizer.chat_template = FALLBACKS[arch][0]
    return tokenizer


def has_vocabulary(path: str | os.PathLike) -> bool:
    """Whether the GGUF file at `path` carries a tokenizer (llama.cpp's
    `tokenizer.ggml.tokens`); CheckpointError if it cannot be read."""
    return "tokenizer.ggml.tokens" in _open(Path(path)).fields


def _open(path: Path) -> GGUFReader:
    if not path.is_file():
        raise CheckpointError(f"{path}: GGUF file not found")
    stat = path.stat()
    return _read(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _read(path: Path, mtime_ns: int, size: int) -> GGUFReader:
    """The parsed file, kept while it is unchanged (mtime_ns and size are
    the key): parsing a file's metadata (a vocabulary of tens of thousands
    of tokens) is not free (docs/tuning.md#gguf-reader), and a shard reads
    the file twice (weights, then the tokenizer), the quantizer and the
    tests many times. Readers are only read from."""
    try:
        reader = FastGGUFReader(path, "r")
    except Exception as err:  # the reader raises ValueError, KeyError, struct errors... on bad bytes
        raise CheckpointError(f"{path}: not a valid GGUF file, truncated or corrupt ({_one_line(err)})") from None
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size:
            raise CheckpointError(f"{path}: not a valid GGUF file, truncated (tensor {tensor.name} is cut off)")
    return reader


def _architecture(reader: GGUFReader, path: Path) -> str:
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{path}: unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return arch


def _unpermute_rotary(array: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf.py's LlamaModel.permute on q/k rows ([n_heads * head_dim, ...]).

    The converter regroups each head's rows from [2, head_dim // 2] (HF's
    rotate-half halves) to [head_dim // 2, 2] (interleaved pairs); this swaps
    them back.
    """
    rows = array.shape[0]
    per_head = array.reshape(n_heads, rows // n_heads // 2, 2, *array.shape[1:])
    return per_head.swapaxes(1, 2).reshape(array.shape)


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__
