"""CUDA benchmark of the Triton weight-only quantized GEMM (tgi_kernels.triton
.quant_matmul_kernel): `python -m benchmarks.quant_cuda` on a GPU machine.

For a 1.1B Llama's MLP shapes (K 2048 -> N 5632 and K 5632 -> N 2048) at
M = 1, 16, 128, 1024 rows of bf16 activations, GPU microseconds per GEMM:
  bf16        torch F.linear with the bf16 weight
  int4_g128   quant_matmul, 4-bit, groups of 128 (its default path for M)
  int8        quant_matmul, 8-bit, one scale per row
  int4_fused  the fused kernel forced (M > FUSED_MAX_M, where it is not the default)
  int4_s1     the fused kernel without split-K (where the default splits)
  dequant     dequantize the 4-bit weight with torch ops, then F.linear
              (QuantLinear's "dequant" path before this kernel)
Each case is captured in a CUDA graph and replayed after a 256 MB write that
evicts the L2 (the weight comes from HBM as in a full model, and the Python
launch cost, which serving hides with CUDA graphs, is left out); median of
REPEATS. Prints ONE JSON line; well under a minute on an H200 (mostly Triton
compiles).

`--sweep`: instead, times the fused 4-bit kernel over candidate tile configs
(SWEEP) at M = 1 and 16, for tuning DECODE; one JSON line.
"""

import json
import statistics
import sys
import time
from functools import partial

import torch
from torch.nn import functional as F

SHAPES = ((2048, 5632), (5632, 2048))  # (K, N)
ROWS = (1, 16, 128, 1024)
REPEATS = 30
# Candidate (block_m, block_n, block_k, num_warps, num_stages) for --sweep.
SWEEP = [(16, 32, 128, 4, 4), (16, 32, 128, 4, 6), (16, 64, 128, 4, 4), (16, 32, 64, 4, 6),
         (16, 16, 128, 2, 4), (16, 32, 256, 4, 3)]
SWEEP_SHAPES = SHAPES + ((2048, 256),)  # + a k/v projection (N 256): few tiles, where split-K matters


class GraphTimer:
    """GPU time of a function replayed from a CUDA graph, L2 evicted before each replay."""

    def __init__(self, device: torch.device):
        self.flush = torch.empty(64 << 20, dtype=torch.int32, device=device)  # 256 MB > the L2
        self.stream = torch.cuda.Stream(device)

    def __call__(self, fn) -> float:
        fn()  # compile outside the capture
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            fn()  # warm-up on a side stream, as torch.cuda.graphs advises
        torch.cuda.current_stream().wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        times = []
        for _ in range(REPEATS):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            times.append((start, end))
        torch.cuda.synchronize()
        return round(1000 * statistics.median(s.elapsed_time(e) for s, e in times), 1)


def _int4(qk, k, n, device, gen):
    q = torch.randint(0, 16, (n, k), device=device, generator=gen, dtype=torch.uint8)
    group = torch.arange(k, device=device) // 128
    scales = torch.rand(n, k // 128, device=device, generator=gen) * 0.01 + 0.001
    return q, scales, -8 * scales, group, qk.pack_quantized(q, scales, -8 * scales, group, 4)


def _dequant_linear(x, q, scales, offsets, group):
    """QuantLinear's "dequant" path: dequantize the whole weight with torch ops, then F.linear."""
    return F.linear(x, q.to(x.dtype) * scales[:, group] + offsets[:, group])


def main() -> None:
    import triton

    from tgi_kernels.triton import quant_matmul_kernel as qk

    assert torch.cuda.is_available(), "needs a CUDA device"
    begin = time.perf_counter()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    timer = GraphTimer(device)
    results = []
    for k, n in SHAPES:
        w = torch.randn(n, k, device=device, generator=gen, dtype=torch.bfloat16) * 0.02
        q4, s4, o4, group, int4 = _int4(qk, k, n, device, gen)
        q8 = torch.randint(0, 256, (n, k), device=device, generator=gen, dtype=torch.uint8)
        s8 = torch.rand(n, 1, device=device, generator=gen) * 0.001 + 0.0001
        int8 = qk.pack_quantized(q8, s8, -128 * s8, torch.zeros(k, dtype=torch.int64, device=device), 8)
        # QuantLinear's dequant path: uint8 values, scales/offsets in the activation dtype.
        s4b, o4b = s4.to(torch.bfloat16), o4.to(torch.bfloat16)
        for m in ROWS:
            x = torch.randn(m, k, device=device, generator=gen, dtype=torch.bfloat16)
            cases = {
                "bf16": partial(F.linear, x, w),
                "int4_g128": partial(qk.quant_matmul, x, int4),
                "int8": partial(qk.quant_matmul, x, int8),
                "dequant": partial(_dequant_linear, x, q4, s4b, o4b, group),
            }
            splits = qk.default_split_k(m, n, k, qk.tile_config(m, 128), device)
            if m > qk.FUSED_MAX_M:
                cases["int4_fused"] = partial(qk.quant_matmul, x, int4, fused=True)
            elif splits > 1:
                cases["int4_s1"] = partial(qk.quant_matmul, x, int4, split_k=1)
            row = {"K": k, "N": n, "M": m, "fused": m <= qk.FUSED_MAX_M, "split_k": splits}
            for name, fn in cases.items():
                row[f"{name}_us"] = timer(fn)
            row["int4_vs_bf16"] = round(row["bf16_us"] / row["int4_g128_us"], 2)
            results.append(row)
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "triton": triton.__version__, "seconds": round(time.perf_counter() - begin, 1),
                      "results": results}))


def sweep() -> None:
    from tgi_kernels.triton import quant_matmul_kernel as qk

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    timer = GraphTimer(device)
    results = []
    for k, n in SWEEP_SHAPES:
        int4 = _int4(qk, k, n, device, gen)[-1]
        for m in (1, 16):
            x = torch.randn(m, k, device=device, generator=gen, dtype=torch.bfloat16)
            for c in SWEEP:
                config = qk.TileConfig(*c)
                splits = qk.default_split_k(m, n, k, config, device)
                for split in sorted({1, splits}):
                    us = timer(partial(qk.quant_matmul, x, int4, split_k=split, config=config))
                    results.append({"K": k, "N": n, "M": m, "config": c, "split_k": split, "us": us})
    print(json.dumps({"sweep": results}))


if __name__ == "__main__":
    sweep() if "--sweep" in sys.argv[1:] else main()
