"""The triton attention backend: our own Triton kernels for store_kv,
paged_decode and varlen_prefill, with tgi_kernels' signatures.

`triton` is imported only when a kernel first runs, so the server works
without the package. The kernels run on CUDA, and on CPU under Triton's
interpreter, which triton enables from the environment variable
TRITON_INTERPRET=1 when it decorates a kernel: the variable must be set
before the backend is first used in the process (tests and benchmarks only;
the interpreter is far too slow to serve).
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch

from ..metadata import DecodeMeta, PrefillMeta


@functools.cache
def _importable() -> bool:
    try:
        import triton  # noqa: F401  (only whether it imports)
    except (ImportError, OSError):  # OSError: a broken install (missing shared libraries)
        return False
    return True


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def is_available(device: torch.device) -> bool:
    """True when triton imports and can run on `device`: any CUDA device, or
    the CPU under the interpreter."""
    runs_here = device.type == "cuda" or (device.type == "cpu" and interpreting())
    return runs_here and _importable()  # no import at all on a CPU server


@functools.cache
def _kernel(name: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{name}")


def store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """See tgi_kernels.store_kv; negative slots are skipped."""
    _kernel("store_kv_kernel").store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def rotary_store_kv(qkv, cos, signed_sin, num_heads: int, k_cache, v_cache, slot_mapping,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """See tgi_kernels.rotary_store_kv; negative slots are skipped."""
    _kernel("store_kv_kernel").rotary_store_kv(qkv, cos, signed_sin, num_heads, k_cache, v_cache, slot_mapping,
                                               k_scale, v_scale)


# The activations' dtypes the per-token kernels serve: they sum and multiply in
# float32, which float64 would lose (it stays on torch's ops).
NORM_ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rms_norm(x, weight, eps: float, residual=None):
    """x [T, N] -> RMSNorm(x) [T, N]; with residual: residual += x in place first (see norm_act_kernel.rms_norm)."""
    return _kernel("norm_act_kernel").rms_norm(x, weight, eps, residual)


def gated_act(gate_up, act: str):
    """gate_up [T, 2 I] -> act(gate) * up [T, I], act "silu" or "gelu_tanh" (see norm_act_kernel.gated_act)."""
    return _kernel("norm_act_kernel").gated_act(gate_up, act)


def _no_softcap(softcap: float) -> None:
    if softcap:
        raise ValueError("the triton attention backend has no soft cap (gemma2's attn_logit_softcapping)")


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: DecodeMeta,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """query [B, H, D] -> out [B, H, D]; see tgi_kernels.paged_decode.

    meta.max_seq_len only sets the number of splits, so a CUDA graph captured
    with a large bound replays correctly for any shorter contexts. No soft
    cap (not in SOFTCAP_BACKENDS: a shard refuses this backend for such a model)."""
    _no_softcap(softcap)
    return _kernel("paged_decode_kernel").paged_decode(
        query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.max_seq_len, scale, sliding_window
    )


def varlen_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PrefillMeta,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """query [T, H, D], key/value [T, KVH, D] -> out [T, H, D]; see tgi_kernels.varlen_prefill."""
    _no_softcap(softcap)
    return _kernel("varlen_prefill_kernel").varlen_prefill(
        query, key, value, k_cache, v_cache, meta.cu_seqlens_q, meta.prefix_lens, meta.block_tables,
        meta.max_query_len, scale, sliding_window,
    )


def pack_quantized(q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group: torch.Tensor, bits: int):
    """A quantized weight (q [N, K] uint8; scales, offsets [N, G]; group [K]; bits 4 or 8) in the layout
    quant_matmul streams; see quant_matmul_kernel.pack_quantized. Once, at load."""
    return _kernel("quant_matmul_kernel").pack_quantized(q, scales, offsets, group, bits)


def quant_matmul(x: torch.Tensor, weight) -> torch.Tensor:
    """x [M, K] -> x @ dequantized(weight).T [M, N] in x's dtype; see quant_matmul_kernel.quant_matmul."""
    return _kernel("quant_matmul_kernel").quant_matmul(x, weight)
