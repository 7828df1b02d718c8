"""The one place that picks how a checkpoint's linears are loaded: from
`--quantize`, else from config.json's quantization_config (as TGI does), else
from the file format (GGUF serves its own blocks)."""

from typing import Protocol

import torch

from ..weights.errors import CheckpointError
from .awq import AWQFormat
from .eetq import EETQFormat
from .gptq import GPTQFormat
from .quantized_matrix import QuantizedMatrix

METHODS = ("gptq", "awq", "eetq")


class LinearFormat(Protocol):
    """A weights-loader strategy for linear layers."""

    name: str

    def load(self, weights, prefix: str, dim: int, start: int, stop: int) -> QuantizedMatrix | torch.Tensor:
        """Output rows (dim 0) or input columns (dim 1) [start, stop) of the
        linear `prefix` (a TensorSource `weights`), quantized or as a dense
        tensor in the serving dtype."""
        ...


def linear_format(quantize: str | None, quant_config: dict | None) -> LinearFormat | None:
    """The format of a safetensors checkpoint's linears; None: plain dense.
    CheckpointError when the flag and the checkpoint disagree or the method
    cannot be served."""
    stored = (quant_config or {}).get("quant_method")
    if quantize is None:
        quantize = stored
    elif stored and stored != quantize:
        raise CheckpointError(f"--quantize {quantize} does not match the checkpoint's quant_method {stored!r}")
    if quantize is None:
        return None
    if quantize == "eetq":
        if stored:
            raise CheckpointError(f"--quantize eetq needs a float checkpoint, this one is {stored}")
        return EETQFormat()
    if quantize not in METHODS:
        raise CheckpointError(f"quantization {quantize!r} is not supported (supported: {', '.join(METHODS)})")
    if not quant_config:
        raise CheckpointError(f"--quantize {quantize}: config.json has no quantization_config")
    bits, group_size = int(quant_config.get("bits", 4)), int(quant_config.get("group_size", 128))
    if quantize == "awq":
        if bits != 4 or quant_config.get("version", "gemm").lower() != "gemm":
            raise CheckpointError("AWQ checkpoints are served in the 4-bit GEMM layout only")
        return AWQFormat(group_size)
    if bits not in (4, 8):
        raise CheckpointError(f"GPTQ with {bits} bits is not supported (supported: 4, 8)")
    return GPTQFormat(bits, group_size, quant_config.get("checkpoint_format", "gptq") != "gptq_v2")
