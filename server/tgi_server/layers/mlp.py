"""The gated MLP: down(act(gate(x)) * up(x)); gate and up share one GEMM."""

import torch
from torch import nn

from tgi_kernels.native import native_ops

from ..distributed import TensorParallel
from ..weights.source import TensorSource
from .activation import gated_activation
from .linear import Linear


class GatedMLP(nn.Module):
    """x [T, hidden] -> [T, hidden], act silu (SwiGLU) or GELU-tanh (GeGLU).

    Each rank holds its share of the intermediate size (gate/up column-parallel,
    down row-parallel)."""

    def __init__(self, gate_up: nn.Module, down: nn.Module, act: str):
        super().__init__()
        self.down, self.act = down, act
        # gate_up's weight lives in one of the two: the fused GEMM's layout where it serves.
        self.fused = FusedGateUp(gate_up, act) if FusedGateUp.serves(gate_up) else None
        self.gate_up = None if self.fused is not None else gate_up

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
        if self.fused is not None:
            return self.down(self.fused(x))
        return self.down(gated_activation(self.gate_up(x), self.act))  # gate_up: [T, 2 I / world_size]


class FusedGateUp(nn.Module):
    """x [T, hidden] -> act(x @ gate.T + b_gate) * (x @ up.T + b_up) [T, I] in
    one bf16 GEMM (csrc/bf16_gemm.cpp's bf16_mm_gated): gate_up's blocks of 16
    rows in turn, gate's then up's, so that each tile holds both halves of its
    16 outputs and applies the activation before anything is stored. The same
    bits as gate_up followed by gated_activation, without writing and reading
    back the [T, 2 I] intermediate or a pass of its own for the activation."""

    def __init__(self, gate_up: Linear, act: str):
        super().__init__()
        lanes = gate_up.lanes  # [2 I / 16, K / 2, 16, 2]: gate's blocks, then up's
        blocks = lanes.shape[0] // 2
        self.lanes = lanes.view(2, blocks, *lanes.shape[1:]).transpose(0, 1).reshape(lanes.shape).contiguous()
        self.bias = gate_up.bias  # [2 I] float32 or None
        self.in_features, self.out_features, self.act = gate_up.in_features, gate_up.out_features // 2, act

    @staticmethod
    def serves(gate_up: nn.Module) -> bool:
        """True for a whole (not LoRA-wrapped, not quantized) Linear on our
        bf16 GEMM whose halves are whole 16-row blocks."""
        return (type(gate_up) is Linear and gate_up.lanes is not None and gate_up.lanes.dtype == torch.bfloat16
                and gate_up.reduce is None and gate_up.out_features % 32 == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = native_ops().bf16_mm_gated(x.reshape(-1, self.in_features).contiguous(), self.lanes, self.out_features,
                                       self.bias, self.act)
        return y.view(*x.shape[:-1], self.out_features)
