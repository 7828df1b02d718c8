"""Our Q4_K and Q6_K encoders (benchmarks/gguf_kquants.py) against gguf-py's
own decoders: the bytes decode to the input within each type's grid, every
grid value is reachable, and degenerate blocks (zeros, one sign) survive."""

import gguf
import numpy as np
import pytest

from benchmarks.gguf_kquants import Q4_K_BYTES, Q6_K_BYTES, quantize_q4_k, quantize_q6_k

TYPES = {"Q4_K": (quantize_q4_k, gguf.GGMLQuantizationType.Q4_K, Q4_K_BYTES),
         "Q6_K": (quantize_q6_k, gguf.GGMLQuantizationType.Q6_K, Q6_K_BYTES)}


def decoded(name: str, x: np.ndarray) -> np.ndarray:
    encode, kind, block_bytes = TYPES[name]
    data = encode(x)
    assert data.dtype == np.uint8 and data.shape == (x.shape[0], x.shape[1] // 256 * block_bytes)
    assert gguf.GGML_QUANT_SIZES[kind] == (256, block_bytes)
    return gguf.quants.dequantize(data, kind).reshape(x.shape)


@pytest.mark.parametrize("name", TYPES)
def test_random_weights_decode_within_the_grid(name):
    """Per sub-block the error is at most half a step of its grid, plus the
    sub-block scale's own rounding against the block's fp16 scale."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8, 1024)) * rng.uniform(0.01, 2, (8, 1))).astype(np.float32)
    y = decoded(name, x)
    sub = 32 if name == "Q4_K" else 16
    blocks = x.reshape(-1, sub)
    if name == "Q4_K":  # min-max over 15 steps
        step = (blocks.max(-1) - np.minimum(blocks.min(-1), 0)) / 15
    else:               # the largest magnitude is level -32
        step = np.abs(blocks).max(-1) / 32
    err = np.abs(y - x).reshape(-1, sub).max(-1)
    # half a step from rounding, up to ~a step more where the quantized sub-block
    # scale (6 or 8 bits against the block's largest) lands below the ideal one
    assert (err <= 1.6 * step + 1e-6).all(), (err / step).max()
    rel = np.sqrt(((y - x) ** 2).mean() / (x ** 2).mean())
    assert rel < (0.12 if name == "Q4_K" else 0.03)


@pytest.mark.parametrize("name", TYPES)
def test_values_on_the_grid_come_back_exactly(name):
    """A block of exact grid points decodes to itself, every level used: its
    scales chosen so that the block's fp16 scale holds them exactly (Q4_K:
    a sub-block step of 63 * 2^-11 is d = 2^-11 times 63; Q6_K: a step of
    2^-5 is d = -2^-12 times -128)."""
    if name == "Q4_K":
        x = np.resize(np.arange(16), 256).astype(np.float32) * 63 * 2.0 ** -11
    else:
        x = np.resize(np.arange(-32, 32), 256).astype(np.float32) * 2.0 ** -5
        x[::16] = -32 * 2.0 ** -5  # each sub-block of 16 has -32 as its largest magnitude
    np.testing.assert_array_equal(decoded(name, x[None]), x[None])


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("fill", [0.0, 3.0, -3.0])
def test_constant_blocks(name, fill):
    x = np.full((2, 256), fill, np.float32)
    np.testing.assert_allclose(decoded(name, x), x, rtol=1e-3, atol=0)


def test_rows_must_split_into_blocks():
    with pytest.raises(ValueError, match="blocks of 256"):
        quantize_q4_k(np.zeros((1, 100), np.float32))
