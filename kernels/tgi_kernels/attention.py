"""Attention entry points: pick a backend and call it.

Backends, all with the same two functions (`paged_decode`, `varlen_prefill`):
  reference   plain torch, one sequence at a time, float32 softmax; the test oracle
  sdpa        torch scaled_dot_product_attention; runs anywhere
  cpu         our C++ kernels (tgi_kernels.cpu): the fast CPU path, where they build
  flash_attn  flash-attn 2 (CUDA, fp16/bf16), only when `flash_attn` imports
  triton      our Triton kernels (tgi_kernels.triton): CUDA, or CPU under TRITON_INTERPRET=1

The default is the one place that picks: flash_attn on CUDA when it imports,
else triton on CUDA when it imports, else sdpa; on CPU cpu where our C++
kernels build, else sdpa (triton's interpreter is for tests). The choice of a
forced backend (env TGI_ATTENTION_BACKEND, flag --attention-backend) is read
by the caller and passed in, not read here.
"""

from __future__ import annotations

from typing import Protocol

import torch

from . import cpu, flash, reference, sdpa
from . import triton as triton_backend
from .metadata import DecodeMeta, PrefillMeta


class AttentionBackend(Protocol):
    """What each backend module provides: the two functions below, with their
    contracts, minus the `backend` argument (tests check every module's signatures)."""

    def paged_decode(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: DecodeMeta, scale: float, sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor: ...

    def varlen_prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PrefillMeta, scale: float,
                       sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor: ...


BACKENDS: dict[str, AttentionBackend] = {
    "reference": reference, "sdpa": sdpa, "cpu": cpu, "flash_attn": flash, "triton": triton_backend,
}
# Those that cap scores softly (gemma2's attn_logit_softcapping); triton does not yet.
SOFTCAP_BACKENDS = ("reference", "sdpa", "cpu", "flash_attn")


def available_backends(device: torch.device) -> list[str]:
    """Names of the backends that run on `device`, in a fixed order."""
    names = ["reference", "sdpa"]
    device = torch.device(device)
    if cpu.is_available(device):
        names.append("cpu")
    if flash.is_available(device):
        names.append("flash_attn")
    if triton_backend.is_available(device):
        names.append("triton")
    return names


def select_backend(device: torch.device, forced: str | None = None, fp8_kv: bool = False) -> str:
    """The backend name to use on `device`: `forced` if given, else the default
    (fp8_kv, a float8 KV cache: on CUDA triton, which reads it in place, before
    flash_attn, which gathers it into 16-bit copies).

    Raises ValueError, naming the available backends, when `forced` is unknown or
    cannot run on `device`.
    """
    available = available_backends(device)
    if forced:
        if forced not in available:
            raise ValueError(
                f"attention backend {forced!r} is not available on {device}; available: {', '.join(available)}"
            )
        return forced
    if torch.device(device).type == "cuda":
        preferred = ("triton", "flash_attn") if fp8_kv else ("flash_attn", "triton")
    else:
        preferred = ("cpu",)
    return next((name for name in preferred if name in available), "sdpa")


def _backend(device: torch.device, name: str | None) -> AttentionBackend:
    # An explicit name is checked only for existence: the caller validates it once,
    # through select_backend, rather than on every layer of every step.
    if name is None:
        return BACKENDS[select_backend(device)]
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}")
    return BACKENDS[name]


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: DecodeMeta,
    scale: float,
    sliding_window: int = 0,
    backend: str | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context.

    query [B, H, D]; k_cache/v_cache [num_blocks, block_size, KVH, D] already holding
    the current token; H a multiple of KVH (query head h reads kv head h // (H // KVH)).
    The cache may be float8 (fp8.py): its values are read as they are.
    Query b sits at position seq_lens[b] - 1 and sees keys j with
    seq_lens[b] - 1 - sliding_window < j <= seq_lens[b] - 1 (no lower bound when
    sliding_window is 0). softcap > 0: each scaled score s becomes
    softcap * tanh(s / softcap) before the softmax (SOFTCAP_BACKENDS only).
    Returns out [B, H, D] in query's dtype.
    """
    impl = _backend(query.device, backend)
    return impl.paged_decode(query, k_cache, v_cache, meta, scale, sliding_window, softcap)


def varlen_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PrefillMeta,
    scale: float,
    sliding_window: int = 0,
    backend: str | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of a packed batch of chunks, each after an optional cached prefix.

    query [T, H, D]; key/value [T, KVH, D] for the chunk tokens, which are also already
    in the cache (a float8 cache's values read as they are). Query token i of sequence b
    sits at position p = prefix_lens[b] + i and sees keys j with p - sliding_window < j <= p;
    keys j < prefix_lens[b] are read from the cache. softcap as in paged_decode.
    Returns out [T, H, D] in query's dtype.
    """
    impl = _backend(query.device, backend)
    return impl.varlen_prefill(query, key, value, k_cache, v_cache, meta, scale, sliding_window, softcap)
