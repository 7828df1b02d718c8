"""Attention kernels over a paged KV cache, with interchangeable backends.

Public API: store_kv, rotary_store_kv, fuses_rotary, paged_decode, varlen_prefill, select_backend,
available_backends, SOFTCAP_BACKENDS, FP8_KV_DTYPES, key_rotation, and the metadata types PrefillMeta /
DecodeMeta.
"""

from .attention import SOFTCAP_BACKENDS, available_backends, paged_decode, select_backend, varlen_prefill
from .fp8 import FP8_KV_DTYPES, key_rotation
from .kv_store import fuses_rotary, rotary_store_kv, store_kv
from .metadata import DecodeMeta, PrefillMeta, build_decode_meta, build_prefill_meta

__all__ = [
    "FP8_KV_DTYPES",
    "SOFTCAP_BACKENDS",
    "DecodeMeta",
    "PrefillMeta",
    "available_backends",
    "build_decode_meta",
    "build_prefill_meta",
    "paged_decode",
    "select_backend",
    "fuses_rotary",
    "key_rotation",
    "rotary_store_kv",
    "store_kv",
    "varlen_prefill",
]
