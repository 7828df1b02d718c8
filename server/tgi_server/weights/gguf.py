"""GGUF checkpoints (llama.cpp's single-file format) in Hugging Face terms.

`GGUFFile` opens a GGUF file of a dense family we serve (llama, mistral,
qwen2, qwen3, gemma2, gemma3) and names its tensors as `transformers`' model class
for it does, with a config.json-equivalent dict; it dequantizes a tensor when
asked for it. `load_gguf` dequantizes them all.
llama.cpp's converter interleaves the rows of q_proj and k_proj of llama
models for its rotary kernel; the loader undoes that, so the tensors drop into
HF-layout model code (rotate-half RoPE) unchanged. For Gemma it stores each
RMSNorm's 1 + w; the loader gives back w, as transformers' GGUF loader does.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from .errors import CheckpointError
from .gguf_chat import FALLBACKS
from .gguf_rope import llama3_scaling

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")
_MODEL_TYPES = {"gemma3": "gemma3_text"}  # GGUF architecture -> transformers model_type, where they differ
_HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
# Architectures whose q/k rows llama.cpp's converter permuted (LlamaModel.permute).
_PERMUTED = ("llama", "mistral")
# Architectures whose norm weights llama.cpp stores as 1 + w.
_NORMS_PLUS_ONE = ("gemma2", "gemma3")

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Gemma's four norms a layer: ffn_norm is the MLP's input norm, as in llama,
# but transformers calls it pre_feedforward_layernorm there.
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                      "post_attention_norm": "post_attention_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp keeps Llama 3's rope scaling as this tensor of per-frequency divisors.
_ROPE_FREQS = "rope_freqs.weight"


@dataclass(frozen=True)
class GGUFCheckpoint:
    """A GGUF file's model in Hugging Face terms.

    config: a config.json-equivalent dict (model_type "llama" | "mistral" |
        "qwen2", sizes, rope_theta, rope_scaling (None or an HF-style dict),
        tie_word_embeddings, bos/eos ids, sliding_window, attention_bias).
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
        self.config = _config(reader, arch, shapes, self.path)
        # HF name -> (GGUF tensor, its GGUF kind, HF shape)
        self._tensors = {}
        self._norms_plus_one = arch in _NORMS_PLUS_ONE
        layer_names = _GEMMA_LAYER_NAMES if arch in _NORMS_PLUS_ONE else _LAYER_NAMES
        for tensor in reader.tensors:
            if tensor.name != _ROPE_FREQS:
                hf_name, kind = _hf_name(tensor.name, layer_names, self.path)
                self._tensors[hf_name] = (tensor, kind, shapes[tensor.name])
        _check_shapes({name: shape for name, (_, _, shape) in self._tensors.items()}, self.config, self.path)

    @property
    def names(self) -> list[str]:
        return list(self._tensors)

    def tensor(self, name: str) -> np.ndarray:
        """Tensor `name` dequantized to float32 in its HF shape and row order; KeyError if absent."""
        tensor, kind, shape = self._tensors[name]
        array = _dequantize(tensor, shape, self.path)
        if self._norms_plus_one and kind.endswith("norm"):
            array = array - np.float32(1)
        order = self._row_order(name)
        return array if order is None else array[order]

    def blocks(self, name: str) -> tuple[np.ndarray, GGMLQuantizationType, np.ndarray | None]:
        """Tensor `name` as stored: (bytes [rows, bytes per row] uint8, block
        type, the row order giving HF's rows or None); KeyError if absent."""
        tensor = self._tensors[name][0]
        return np.asarray(tensor.data), GGMLQuantizationType(tensor.tensor_type), self._row_order(name)

    def _row_order(self, name: str) -> np.ndarray | None:
        tensor, kind, shape = self._tensors[name]
        if self.config["model_type"] not in _PERMUTED or kind not in ("attn_q", "attn_k"):
            return None
        heads = self.config["num_attention_heads" if kind == "attn_q" else "num_key_value_heads"]
        return _unpermute_rotary(np.arange(shape[0]), heads)


def load_gguf(path: str | os.PathLike, dtype: torch.dtype) -> GGUFCheckpoint:
    """Read, dequantize and rename the whole GGUF file at `path`; CheckpointError if it cannot be served."""
    file = GGUFFile(path)
    return GGUFCheckpoint(config=file.config,
                          tensors={name: torch.tensor(file.tensor(name), dtype=dtype) for name in file.names})


def load_gguf_tokenizer(path: str | os.PathLike):
    """The file's tokenizer (a PreTrainedTokenizerFast) with its vocab, special tokens and chat_template."""
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    arch = _architecture(_open(path), path)
    try:
        # Not AutoTokenizer: it also parses the whole file into a config first (~6 s for SmolLM2, vs 0.3 s).
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as err:  # transformers raises many types for a vocabulary it cannot convert
        raise CheckpointError(f"{path}: cannot build the tokenizer ({_one_line(err)})") from None
    if tokenizer.chat_template is None and arch in FALLBACKS:
        tokenizer.chat_template = FALLBACKS[arch][0]
    return tokenizer


class _Reader(GGUFReader):
    """GGUFReader over a plain-ndarray view of its memory map.

    numpy.memmap runs Python hooks on every slice; parsing a 49k-token
    vocabulary slice by slice took 3.4 s that way, 0.9 s this way.
    """

    @property
    def data(self) -> np.ndarray:
        return self._mapped

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._mapped = value.view(np.ndarray)


def _open(path: Path) -> GGUFReader:
    if not path.is_file():
        raise CheckpointError(f"{path}: GGUF file not found")
    stat = path.stat()
    return _read(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _read(path: Path, mtime_ns: int, size: int) -> GGUFReader:
    """The parsed file, kept while it is unchanged (mtime_ns and size are
    the key): parsing SmolLM2's metadata (its 49k-token vocabulary) takes
    ~1.1 s, and a shard reads the file twice (weights, then the tokenizer),
    the quantizer and the tests many times. Readers are only read from."""
    try:
        reader = _Reader(path, "r")
    except Exception as err:  # the reader raises ValueError, KeyError, struct errors... on bad bytes
        raise CheckpointError(f"{path}: not a valid GGUF file, truncated or corrupt ({_one_line(err)})") from None
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size:
            raise CheckpointError(f"{path}: not a valid GGUF file, truncated (tensor {tensor.name} is cut off)")
    return reader


def _architecture(reader: GGUFReader, path: Path) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{path}: unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return arch


def _config(reader: GGUFReader, arch: str, shapes: dict[str, tuple[int, ...]], path: Path) -> dict:
    def key(name, default=None):
        return _field(reader, f"{arch}.{name}", default)

    for required in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count"):
        if key(required) is None:
            raise CheckpointError(f"{path}: GGUF metadata lacks {arch}.{required}")
    if "token_embd.weight" not in shapes or "blk.0.attn_q.weight" not in shapes:
        raise CheckpointError(f"{path}: GGUF file lacks token_embd.weight or blk.0.attn_q.weight")
    n_heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", shapes["blk.0.attn_q.weight"][0] // n_heads))
    model_type = _MODEL_TYPES.get(arch, arch)
    if arch == "llama" and "mistral" in str(_field(reader, "general.name", "")).lower():
        model_type = "mistral"  # llama.cpp converts Mistral models to the llama architecture
    rope_theta = _float32(key("rope.freq_base", 10000.0))
    window = key("attention.sliding_window")
    config = {
        "model_type": model_type,
        "architectures": [_HF_CLASSES[model_type]],
        "vocab_size": shapes["token_embd.weight"][0],
        "hidden_size": int(key("embedding_length")),
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(key("attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _float32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "max_position_embeddings": int(key("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_ids(reader, arch),
        "sliding_window": None if window is None else int(window),
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in shapes,
        "rope_scaling": _rope_scaling(reader, arch, rope_theta, head_dim, path),
    }
    for key_name in ("attn_logit_softcapping", "final_logit_softcapping"):  # gemma2's, as llama.cpp writes them
        if key(key_name) is not None:
            config[key_name] = _float32(key(key_name))
    return config


def _eos_ids(reader: GGUFReader, arch: str) -> int | list[int] | None:
    """The file's end-of-sequence id, and for families in gguf_chat.FALLBACKS
    the id of the token that ends a turn, when the vocabulary has it."""
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if arch not in FALLBACKS or tokens is None:
        return eos
    end_of_turn = FALLBACKS[arch][1].encode()
    # field.data indexes the parts holding each token's bytes (no list of 262k strings built)
    turn = next((i for i, part in enumerate(tokens.data) if bytes(tokens.parts[part]) == end_of_turn), None)
    return eos if turn is None or turn == eos else [i for i in (eos, turn) if i is not None]


def _rope_scaling(reader: GGUFReader, arch: str, theta: float, head_dim: int, path: Path) -> dict | None:
    def key(name, default=None):
        return _field(reader, f"{arch}.rope.{name}", default)

    kind = key("scaling.type", "linear" if key("scale_linear") else "none")
    factor = _float32(key("scaling.factor", key("scale_linear", 1.0)))
    if kind == "none" or (kind == "linear" and factor == 1.0):
        freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
        if freqs is None:
            return None
        return llama3_scaling(np.asarray(freqs.data, np.float64), theta, head_dim, path)
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor}
        extra = {
            "original_max_position_embeddings": ("scaling.original_context_length", int),
            "attention_factor": ("scaling.attn_factor", _float32),
            "beta_fast": ("scaling.yarn_beta_fast", _float32),
            "beta_slow": ("scaling.yarn_beta_slow", _float32),
        }
        for hf_key, (gguf_key, cast) in extra.items():
            if key(gguf_key) is not None:
                scaling[hf_key] = cast(key(gguf_key))
        return scaling
    raise CheckpointError(f"{path}: unsupported rope scaling type {kind!r} (supported: linear, yarn)")


def _hf_name(name: str, layer_names: dict[str, str], path: Path) -> tuple[str, str]:
    """(HF name, GGUF tensor kind) of a GGUF tensor name, layer tensors named
    by `layer_names`; CheckpointError for tensors we cannot serve."""
    stem, _, suffix = name.rpartition(".")
    if stem in _GLOBAL_NAMES and suffix == "weight":
        return f"{_GLOBAL_NAMES[stem]}.weight", stem
    match = _LAYER_TENSOR.fullmatch(name)
    if match and match.group(2) in layer_names:
        layer, kind, suffix = match.groups()
        return f"model.layers.{layer}.{layer_names[kind]}.{suffix}", kind
    raise CheckpointError(f"{path}: unsupported tensor {name} in this GGUF file")


def _dequantize(tensor, shape: tuple[int, ...], path: Path) -> np.ndarray:
    try:
        array = dequantize(tensor.data, GGMLQuantizationType(tensor.tensor_type))
    except NotImplementedError:
        raise CheckpointError(
            f"{path}: tensor {tensor.name} has unsupported type {tensor.tensor_type.name}"
        ) from None
    return np.asarray(array, dtype=np.float32).reshape(shape)  # [out, in] for linears


def _unpermute_rotary(array: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf.py's LlamaModel.permute on q/k rows ([n_heads * head_dim, ...]).

    The converter regroups each head's rows from [2, head_dim // 2] (HF's
    rotate-half halves) to [head_dim // 2, 2] (interleaved pairs); this swaps
    them back.
    """
    rows = array.shape[0]
    per_head = array.reshape(n_heads, rows // n_heads // 2, 2, *array.shape[1:])
    return per_head.swapaxes(1, 2).reshape(array.shape)


def _check_shapes(shapes: dict[str, tuple[int, ...]], config: dict, path: Path) -> None:
    """Every tensor the HF model needs is present with the HF shape (`shapes`: HF name -> shape)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    expected = {"model.embed_tokens.weight": (config["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        expected["lm_head.weight"] = (config["vocab_size"], hidden)
    layer_shapes = {
        "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_rows, hidden), "self_attn.k_proj.weight": (kv_rows, hidden),
        "self_attn.v_proj.weight": (kv_rows, hidden), "self_attn.o_proj.weight": (hidden, q_rows),
        "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    if config["attention_bias"]:
        layer_shapes.update({"self_attn.q_proj.bias": (q_rows,), "self_attn.k_proj.bias": (kv_rows,),
                             "self_attn.v_proj.bias": (kv_rows,)})
    if config["model_type"] in ("qwen3", "gemma3_text"):
        layer_shapes.update({"self_attn.q_norm.weight": (config["head_dim"],),
                             "self_attn.k_norm.weight": (config["head_dim"],)})
    if config["model_type"] in ("gemma2", "gemma3_text"):
        layer_shapes.update({"pre_feedforward_layernorm.weight": (hidden,),
                             "post_feedforward_layernorm.weight": (hidden,)})
    for layer in range(config["num_hidden_layers"]):
        expected.update({f"model.layers.{layer}.{name}": shape for name, shape in layer_shapes.items()})
    for name, shape in expected.items():
        if name not in shapes:
            raise CheckpointError(f"{path}: tensor {name} is missing from the GGUF file")
        if shapes[name] != shape:
            got = shapes[name]
            raise CheckpointError(f"{path}: tensor {name} has shape {got}, expected {shape}")
    extra = sorted(name for name in set(shapes) - set(expected) if not name.endswith(".bias"))
    if extra:
        raise CheckpointError(f"{path}: unexpected tensor {extra[0]} in the GGUF file")


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _float32(value) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__
