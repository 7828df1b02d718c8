"""Loads a resolved checkpoint into our model on the serving device and dtype."""

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from .models import ModelConfig, build_model
from .weights.errors import CheckpointError
from .weights.resolve import ModelSource
from .weights.source import DictSource, SafetensorsSource, TensorSource

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    load_seconds: float


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 where the hardware computes it natively, float32 elsewhere on
    CPU, float16 on GPUs without bfloat16."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if _cpu_has_bf16() else torch.float32


def _cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    start = time.perf_counter()
    hf_config, weights = _open(source, dtype, device)
    config = ModelConfig.from_hf(hf_config)
    with torch.device(device):
        model = build_model(weights, config).eval()
    return LoadedModel(model, config, dtype, device, time.perf_counter() - start)


def _open(source: ModelSource, dtype: torch.dtype, device: torch.device) -> tuple[PretrainedConfig, TensorSource]:
    if source.format == "gguf":
        from .weights.gguf import load_gguf

        checkpoint = load_gguf(source.path, dtype)
        return _config_from_dict(checkpoint.config), DictSource(checkpoint.tensors, dtype, device)
    try:
        hf_config = AutoConfig.from_pretrained(source.path)
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"{source.path}/config.json: {str(err).splitlines()[0]}") from None
    quant = getattr(hf_config, "quantization_config", None)
    if quant:
        method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
        raise CheckpointError(f"quantized checkpoints ({method}) are not supported yet")
    return hf_config, SafetensorsSource(source.path, dtype, device)


def _config_from_dict(config: dict) -> PretrainedConfig:
    values = dict(config)
    model_type = values.pop("model_type", None)
    try:
        return AutoConfig.for_model(model_type, **values)
    except ValueError:
        raise CheckpointError(f"unsupported architecture {model_type!r}") from None
