"""Llama 3 RoPE scaling from a GGUF file: llama.cpp stores it as a
`rope_freqs.weight` tensor of per-frequency divisors; Hugging Face as four
numbers. These recover the numbers from the divisors."""

import math
from pathlib import Path

import numpy as np

from .errors import CheckpointError


def llama3_scaling(divisors: np.ndarray, theta: float, head_dim: int, path: Path) -> dict | None:
    """Recover HF's llama3 rope_scaling from llama.cpp's rope_freqs divisors ([head_dim // 2])."""
    inv_freq = theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [head_dim // 2]
    factor = float(divisors.max())
    if factor <= 1.0 + 1e-6:
        return None
    mid = (divisors > 1.0 + 1e-6) & (divisors < factor - 1e-6)
    low, high, original = 1.0, 4.0, 8192  # Meta's Llama 3.1/3.2 values, for a ramp too short to fit
    if mid.sum() >= 2:
        # In the ramp 1/divisor = (1 - s)/factor + s, s = (original*inv_freq/2pi - low)/(high - low):
        # s is linear in inv_freq; fit it, taking low_freq_factor = 1 as every Llama 3 release does.
        s = (1.0 / divisors[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, intercept = np.polyfit(inv_freq[mid] / (2 * math.pi), s, 1)
        if intercept < 0 < slope:
            high = round(float(1.0 - 1.0 / intercept), 3)
            original = int(round(float(slope * (high - low))))
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
               "high_freq_factor": high, "original_max_position_embeddings": original}
    if not np.allclose(llama3_divisors(inv_freq, scaling), divisors, rtol=1e-3):
        raise CheckpointError(f"{path}: rope_freqs.weight is not llama3 rope scaling (unsupported)")
    return scaling


def llama3_divisors(inv_freq: np.ndarray, scaling: dict) -> np.ndarray:
    """llama.cpp's rope_freqs for an HF llama3 rope_scaling (inverse-frequency divisors)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    ratio = scaling["original_max_position_embeddings"] * inv_freq / (2 * math.pi)  # context / wavelength
    smooth = np.clip((ratio - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1.0 - smooth) / factor + smooth)
