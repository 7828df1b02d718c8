"""Model registry: config.json `model_type` -> our implementation."""

from torch import nn

from ..distributed import TensorParallel
from ..weights.source import TensorSource
from .config import ModelConfig
from .decoder import DecoderForCausalLM
from .families import FAMILIES

MODELS: dict[str, type[nn.Module]] = {name: DecoderForCausalLM for name in FAMILIES}


def build_model(weights: TensorSource, config: ModelConfig, tp: TensorParallel) -> nn.Module:
    """tp's rank's slice of the model."""
    return MODELS[config.model_type](weights, config, tp)


__all__ = ["MODELS", "ModelConfig", "build_model"]
