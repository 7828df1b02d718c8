"""Bit packing of the GPTQ and AWQ checkpoint formats (int32 words holding
32 / bits values each), both ways: loaders unpack, the quantizer packs.

GPTQ packs qweight along the input dimension (qweight [K * bits / 32, N]) and
qzeros along the output dimension ([G, N * bits / 32]); value j of a word sits
at bits [j * bits, (j + 1) * bits). AWQ's GEMM layout packs both along the
output dimension ([K, N / 8], [G, N / 8]) and interleaves the eight values of
a word in the order AWQ_ORDER (word slot i holds column AWQ_ORDER[i])."""

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> uint8 values, `32 // bits` per word, spread along `dim`
    (0 or 1) in slot order: [A, B] -> [A * per, B] or [A, B * per]."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)  # [per]
    if dim == 0:
        values = (packed[:, None, :] >> shifts[None, :, None]) & (2 ** bits - 1)  # [A, per, B]
        return values.reshape(-1, packed.shape[1]).to(torch.uint8)
    values = (packed[:, :, None] >> shifts[None, None, :]) & (2 ** bits - 1)  # [A, B, per]
    return values.reshape(packed.shape[0], -1).to(torch.uint8)


def pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of `unpack`: uint8/int values [A * per, B] (dim 0) or
    [A, B * per] (dim 1) -> int32 words."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    v = values.to(torch.int64)
    if dim == 0:
        words = (v.reshape(-1, per, v.shape[1]) << shifts[None, :, None]).sum(1)
    else:
        words = (v.reshape(v.shape[0], -1, per) << shifts[None, None, :]).sum(2)
    # Two's complement into int32: values above 2**31 wrap as the format expects.
    return ((words + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32)


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's 4-bit words [A, B] -> values [A, 8 * B] in natural column order."""
    values = unpack(packed, 4, dim=1).reshape(packed.shape[0], -1, 8)
    return values[:, :, list(AWQ_REVERSE_ORDER)].reshape(packed.shape[0], -1)


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """Values [A, 8 * B] in natural column order -> AWQ's 4-bit words [A, B]."""
    interleaved = values.reshape(values.shape[0], -1, 8)[:, :, list(AWQ_ORDER)]
    return pack(interleaved.reshape(values.shape[0], -1), 4, dim=1)
