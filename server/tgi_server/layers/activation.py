"""Gated MLP activations on the fused gate_up output: SwiGLU (silu) and
GeGLU with tanh-approximated GELU (gemma)."""

import torch
from torch.nn import functional as F

from tgi_kernels import triton as triton_kernels
from tgi_kernels.native import native_ops


def gated_activation(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """gate_up [T, 2 I] (gate columns, then up) -> act(gate) * up [T, I],
    act "silu" or "gelu_tanh"; one pass in our C++ kernel on CPU and in our
    Triton kernel on CUDA (three kernels and two temporaries in plain torch)."""
    ops = native_ops() if gate_up.device.type == "cpu" and gate_up.dim() == 2 else None
    if ops is not None:
        return ops.silu_mul(gate_up) if act == "silu" else ops.gelu_tanh_mul(gate_up)
    if (gate_up.device.type == "cuda" and gate_up.dim() == 2 and gate_up.stride(-1) == 1
            and gate_up.dtype in triton_kernels.NORM_ACT_DTYPES and triton_kernels.is_available(gate_up.device)):
        return triton_kernels.gated_act(gate_up, act)
    gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
    return (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up
