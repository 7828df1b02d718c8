"""EETQ: per-channel symmetric int8 weight-only quantization, done at load
time from any float checkpoint (the int8 values are never stored on disk)."""

from dataclasses import dataclass

from .quantized_matrix import QuantizedMatrix, quantize_rtn


@dataclass(frozen=True)
class EETQFormat:
    name: str = "eetq"

    def load(self, weights, prefix: str, dim: int, start: int, stop: int) -> QuantizedMatrix:
        """Rows (dim 0) or columns (dim 1) [start, stop) of `prefix.weight`, quantized."""
        return quantize_rtn(weights.get_slice(f"{prefix}.weight", dim, start, stop), 8, -1, symmetric=True)
