"""SwiGLU's gate on the fused gate_up output."""

import torch
from torch.nn import functional as F

from tgi_kernels.native import native_ops


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 I] (gate columns, then up) -> silu(gate) * up [T, I];
    one pass in our C++ kernel on CPU (three kernels and two temporaries
    in plain torch)."""
    ops = native_ops() if gate_up.device.type == "cpu" and gate_up.dim() == 2 else None
    if ops is not None:
        return ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
    return F.silu(gate) * up
