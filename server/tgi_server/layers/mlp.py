"""The gated MLP: down(act(gate(x)) * up(x)); gate and up share one GEMM."""

import torch
from torch import nn

from ..distributed import TensorParallel
from ..weights.source import TensorSource
from .activation import gated_activation
from .linear import Linear


class GatedMLP(nn.Module):
    """x [T, hidden] -> [T, hidden], act silu (SwiGLU) or GELU-tanh (GeGLU).

    Each rank holds its share of the intermediate size (gate/up column-parallel,
    down row-parallel)."""

    def __init__(self, gate_up: Linear, down: Linear, act: str):
        super().__init__()
        self.gate_up, self.down = gate_up, down
        self.act = act

    @classmethod
    def load(cls, weights: TensorSource, prefix: str, names: tuple[str, str, str] | str, intermediate: int,
             bias: bool, act: str, tp: TensorParallel, reduce: bool = True) -> "GatedMLP":
        """names: (gate, up, down) under `prefix`, or (phi3) the one
        gate_up tensor's name, gate's rows then up's, with down_proj beside it.
        reduce False: the outputs stay this rank's partial sums (see
        Linear.load_row)."""
        start, stop = tp.split(intermediate)
        if isinstance(names, str):
            fused = f"{prefix}.{names}"
            parts, down = [(fused, start, stop), (fused, intermediate + start, intermediate + stop)], "down_proj"
        else:
            parts, down = [(f"{prefix}.{names[0]}", start, stop), (f"{prefix}.{names[1]}", start, stop)], names[2]
        return cls(Linear.load_column(weights, parts, bias),
                   Linear.load_row(weights, f"{prefix}.{down}", intermediate, bias, tp, reduce), act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(gated_activation(self.gate_up(x), self.act))  # gate_up: [T, 2 I / world_size]
