"""Quantized linear layers: checkpoint formats (GPTQ, AWQ, EETQ, GGUF
blocks) reduced to one QuantizedMatrix, and QuantLinear running it on the
fastest kernel the device has."""

from .methods import METHODS, LinearFormat, linear_format
from .quant_linear import QuantLinear, kernel_counts
from .quantized_matrix import QuantizedMatrix, quantize_rtn, stack_rows

__all__ = ["METHODS", "LinearFormat", "QuantLinear", "QuantizedMatrix", "kernel_counts", "linear_format",
           "quantize_rtn", "stack_rows"]
