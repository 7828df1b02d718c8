"""Where layers get their tensors from: one `TensorSource` per checkpoint
format, all answering in Hugging Face tensor names, in the serving dtype and
on the serving device."""

import json
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open

from .errors import CheckpointError


class TensorSource(Protocol):
    dtype: torch.dtype
    device: torch.device

    def has(self, name: str) -> bool: ...

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name` converted to (dtype, device); CheckpointError if absent."""
        ...


class SafetensorsSource:
    """Tensors of a Hugging Face directory: model.safetensors, or the shards
    listed in model.safetensors.index.json, opened lazily (memory-mapped)."""

    def __init__(self, directory: Path, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, device
        self._file_of: dict[str, Path] = {}
        files = sorted(directory.glob("*.safetensors"))
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
        path = self._file_of.get(name)
        if path is None:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint")
        try:
            tensor = self._handles[path].get_tensor(name)
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{path}: cannot read tensor {name!r} ({err})") from None
        return tensor.to(device=self.device, dtype=self.dtype).contiguous()


class DictSource:
    """Tensors already in memory (a dequantized GGUF file)."""

    def __init__(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, device
        self._tensors = tensors

    def has(self, name: str) -> bool:
        return name in self._tensors

    def get(self, name: str) -> torch.Tensor:
        if name not in self._tensors:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint")
        return self._tensors[name].to(device=self.device, dtype=self.dtype).contiguous()
