"""GGUF's Q4_K and Q6_K blocks written from float weights (numpy), for the
benchmark models' Q4_K_M files: gguf-py decodes these types but cannot
encode them. Layouts are ggml's (block_q4_K, block_q6_K, 256 values a block);
gguf-py's decoders are the tests' oracle (tests/benchmarks/test_gguf_kquants.py).

Grids are min-max (Q4_K) and signed absmax (Q6_K) per sub-block, then the sub-block
scales are themselves quantized against one fp16 scale per block; values are
rounded on the quantized scales. llama.cpp searches its grids for the least
error: ours are a little coarser, which changes no speed figure."""

import numpy as np

QK_K = 256
Q4_K_BYTES = 144  # d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
Q6_K_BYTES = 210  # 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d (fp16)


def _blocks(x: np.ndarray) -> np.ndarray:
    """x [..., K] (K a multiple of 256) -> float32 [B, 256], rows' blocks in order."""
    if x.shape[-1] % QK_K:
        raise ValueError(f"rows of {x.shape[-1]} values do not split into blocks of {QK_K}")
    return np.ascontiguousarray(x, dtype=np.float32).reshape(-1, QK_K)


def _ratio(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """x / scale where scale is not 0, else 0."""
    return np.divide(x, scale, out=np.zeros(np.broadcast_shapes(x.shape, scale.shape), np.float32),
                     where=scale != 0)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """x [rows, K] -> uint8 [rows, K / 256 * 144]: 8 sub-blocks of 32, each
    y = d * sc * q - dmin * m with q in 0..15 and sc, m in 0..63."""
    rows = x.shape[0]
    b = _blocks(x).reshape(-1, 8, 32)                       # [B, 8, 32]
    low = np.minimum(b.min(-1), 0)                          # [B, 8]
    scale, mins = (b.max(-1) - low) / 15, -low              # [B, 8] each, >= 0
    d = (scale.max(-1) / 63).astype(np.float16)             # [B]
    dmin = (mins.max(-1) / 63).astype(np.float16)
    sc = np.clip(np.rint(_ratio(scale, d[:, None].astype(np.float32))), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_ratio(mins, dmin[:, None].astype(np.float32))), 0, 63).astype(np.uint8)
    step = d[:, None].astype(np.float32) * sc               # [B, 8]: the scales as decoded
    offset = dmin[:, None].astype(np.float32) * m
    q = np.clip(np.rint(_ratio(b + offset[..., None], step[..., None])), 0, 15).astype(np.uint8)  # [B, 8, 32]

    packed = np.zeros((len(b), 12), np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)   # sub-blocks 0-3: 6 bits; top 2 of 4-7's scale
    packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)     # the same for the mins
    packed[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    nibbles = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # sub-blocks 2p (low) and 2p+1 (high)
    out = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), packed, nibbles], axis=1)
    return out.reshape(rows, -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """x [rows, K] -> uint8 [rows, K / 256 * 210]: 16 sub-blocks of 16, each
    y = d * sc * q with q in -32..31 and sc an int8."""
    rows = x.shape[0]
    b = _blocks(x).reshape(-1, 16, 16)                      # [B, 16, 16]
    # Signed scales, as ggml's: a sub-block's value of largest magnitude is level -32
    # exactly, and the block's largest scale is sub-block scale -128.
    peak = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)[..., 0]  # [B, 16]
    scale = -peak / 32
    top = np.take_along_axis(scale, np.abs(scale).argmax(-1)[:, None], -1)[:, 0]  # [B]
    d = (-top / 128).astype(np.float16)
    sc = np.clip(np.rint(_ratio(scale, d[:, None].astype(np.float32))), -128, 127).astype(np.int8)
    step = d[:, None].astype(np.float32) * sc               # [B, 16]
    q = (np.clip(np.rint(_ratio(b, step[..., None])), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    # Per 128-value half: value l + 32 k (k = 0..3) keeps its low nibble in ql (k = 0, 1 low; 2, 3 high
    # nibble of bytes l and l + 32) and its top two bits in qh[l] at bit 2 k.
    ql = np.concatenate([q[:, :, 0] & 0xF | (q[:, :, 2] & 0xF) << 4,
                         q[:, :, 1] & 0xF | (q[:, :, 3] & 0xF) << 4], axis=2).reshape(-1, 128)
    qh = (q[:, :, 0] >> 4 | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6).reshape(-1, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), d[:, None].view(np.uint8)], axis=1)
    return out.reshape(rows, -1)
