"""Shape functions of our C++ ops (torch.library fakes), so that torch.compile
can trace a forward that calls them: the kernels are registered for the CPU
dispatch key only (a catch-all kernel would be traced into, with fake
tensors), and these say what each op returns without running it. Each op's
contract is in its csrc/*.cpp."""

import torch


def _gemm(x, weights, scales, n):  # int4_*(x, packed, scale_offset, n), int8_gemv(x, q, scales, n)
    return x.new_empty(x.shape[0], n)


def _exp_block_sums(x, top, temperature, rows, block):
    return x.new_empty(x.shape[0] if rows is None else rows.shape[0], x.shape[1] // block)


FAKES = {
    "bf16_mm": lambda x, w, n, bias: x.new_empty(x.shape[0], n),
    "bf16_mm_gated": lambda x, w, n, bias, act: x.new_empty(x.shape[0], n),
    "f32_mm": lambda x, w, n, bias: x.new_empty(x.shape[0], n),
    "int4_gemv": _gemm, "int4_dequant_mm": _gemm, "int4_amx_mm": _gemm, "int4_gemv_int8x": _gemm,
    "int4_bf16_mm": _gemm, "int8_gemv": _gemm, "int8_gemv_int8x": _gemm,
    "rms_norm": lambda x, weight, eps: torch.empty_like(x),
    "add_rms_norm": lambda x, residual, weight, eps: torch.empty_like(x),
    "silu_mul": lambda gate_up: gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2),
    "gelu_tanh_mul": lambda gate_up: gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2),
    "paged_decode": lambda query, *rest: query.new_empty(query.shape),
    "varlen_prefill": lambda query, *rest: query.new_empty(query.shape),
    "rotary_store_kv": lambda *args: None,
    "lora_add_": lambda *args: None,
    "exp_block_sums": _exp_block_sums,
}


def register_fakes(ops) -> None:
    """Once, after the library loads; ops: torch.ops.tgi. Ops this build
    lacks (varlen_prefill needs AVX2 or AVX-512) are skipped."""
    for name, fake in FAKES.items():
        if hasattr(ops, name):
            torch.library.register_fake(f"tgi::{name}")(fake)
