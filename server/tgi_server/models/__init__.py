"""Model registry: config.json `model_type` -> our implementation."""

from torch import nn

from ..weights.source import TensorSource
from .config import SUPPORTED_MODEL_TYPES, ModelConfig
from .llama import LlamaForCausalLM

MODELS: dict[str, type[nn.Module]] = {name: LlamaForCausalLM for name in SUPPORTED_MODEL_TYPES}


def build_model(weights: TensorSource, config: ModelConfig) -> nn.Module:
    return MODELS[config.model_type](weights, config)


__all__ = ["MODELS", "ModelConfig", "SUPPORTED_MODEL_TYPES", "build_model"]
