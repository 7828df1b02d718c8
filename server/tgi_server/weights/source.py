"""Where layers get their tensors from: one `TensorSource` per checkpoint
format, all answering in Hugging Face tensor names, in the serving dtype and
on the serving device. A tensor-parallel shard asks for its slice only."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from .errors import CheckpointError

if TYPE_CHECKING:
    from ..layers.lora import AdapterSet
    from ..quant.methods import LinearFormat
    from .gguf import GGUFFile


class TensorSource(Protocol):
    dtype: torch.dtype
    device: torch.device
    linear_format: LinearFormat | None  # how linear layers load; None: dense `.weight` tensors
    quant_kernel_dtype: torch.dtype | None  # activations inside quantized CPU kernels; None: dtype
    lora: AdapterSet | None  # LoRA adapters the linears add (layers/lora.py); None: none
    kv_scales: bool  # attention layers read the checkpoint's k/v cache scales (a float8 KV cache)

    def has(self, name: str) -> bool: ...

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name` converted to (dtype, device); CheckpointError if absent."""
        ...

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Indices [start, stop) of tensor `name` along `dim`, converted as by
        `get`, without holding the whole tensor in the serving dtype on the
        serving device; CheckpointError if absent."""
        ...


def _index(dim: int, start: int, stop: int) -> tuple[slice, ...]:
    return (slice(None),) * dim + (slice(start, stop),)


# The file of Medusa heads in a model directory (TGI's name), which is not model weights.
MEDUSA_HEADS_FILE = "medusa_lm_head.safetensors"


class SafetensorsSource:
    """Tensors of a Hugging Face directory: model.safetensors, or the shards
    listed in model.safetensors.index.json, opened lazily (memory-mapped)."""

    def __init__(self, directory: Path, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, device
        self.linear_format = None
        self.quant_kernel_dtype = None
        self.lora = None
        self.kv_scales = False
        self._file_of: dict[str, Path] = {}
        # Medusa heads beside the weights are the speculator's (speculation/medusa.py).
        files = sorted(f for f in directory.glob("*.safetensors") if f.name != MEDUSA_HEADS_FILE)
        index = directory / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as err:
                raise CheckpointError(f"{index}: not a valid safetensors index ({err})") from None
            files = sorted({directory / f for f in weight_map.values()})
        if not files:
            raise CheckpointError(f"{directory}: no *.safetensors files (only safetensors checkpoints are served)")
        self._handles = {}
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as err:
                raise CheckpointError(f"{path}: cannot read safetensors file ({err})") from None
            self._handles[path] = handle
            for name in handle.keys():
                self._file_of[name] = path

    def has(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str) -> torch.Tensor:
        return self._read(name, lambda handle: handle.get_tensor(name))

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        # Reads only the slice's bytes from the memory-mapped file.
        return self._read(name, lambda handle: handle.get_slice(name)[_index(dim, start, stop)])

    def get_raw(self, name: str) -> torch.Tensor:
        """The tensor as stored (its own dtype, on the CPU): packed quantized
        weights are not converted."""
        return self._read(name, lambda handle: handle.get_tensor(name), convert=False)

    def _read(self, name: str, read: Callable[[Any], torch.Tensor], convert: bool = True) -> torch.Tensor:
        path = self._file_of.get(name)
        if path is None:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint")
        try:
            tensor = read(self._handles[path])
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{path}: cannot read tensor {name!r} ({err})") from None
        return tensor.to(device=self.device, dtype=self.dtype).contiguous() if convert else tensor


class GGUFSource:
    """Tensors of a GGUF file, dequantized one at a time as layers ask for
    them: a shard holds only its slices, never the whole dequantized model."""

    def __init__(self, file: GGUFFile, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, device
        self.linear_format = None
        self.quant_kernel_dtype = None
        self.lora = None
        self.kv_scales = False
        self._file = file
        self._names = set(file.names)

    def has(self, name: str) -> bool:
        return name in self._names

    def get(self, name: str) -> torch.Tensor:
        return self._convert(self._array(name))

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return self._convert(self._array(name)[_index(dim, start, stop)])

    def _array(self, name: str) -> np.ndarray:
        if name not in self._names:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint")
        return self._file.tensor(name)  # float32, dequantized

    def _convert(self, array: np.ndarray) -> torch.Tensor:
        # torch.tensor copies: the slice only, never the memory-mapped file.
        return torch.tensor(array, dtype=self.dtype, device=self.device)
