"""Many LoRA adapters in one batch (multi-LoRA serving, as TGI's --lora-adapters).

Every linear that some adapter targets becomes a LoraLinear: the base layer
(dense or quantized) on all tokens, then, for each adapter that the step's
tokens use, its low-rank delta on that adapter's tokens only. The step's
batch lists its sequences grouped by adapter (batch.build_batch), so an
adapter's tokens are one or two contiguous runs of rows (its decodes, its
prefills): per run, one GEMM x A^T and one addmm of B into the output
rows, in place; nothing loops over tokens or gathers them. On the CPU one
C++ call per layer does every run of fewer than GEMM_ROWS rows
(csrc/lora.cpp): at decode's sizes torch's GEMM pairs cost more in set-up
than the whole step (figures: docs/tuning.md#lora-kernel).

Tensor parallelism: a column-parallel layer (q/k/v, gate/up: rows of the
output split over the ranks) keeps A whole and its rows of B; a
row-parallel one (o_proj, down_proj: input columns split) keeps its columns
of A and B whole, so each rank's delta is a partial sum that the layer's
one all-reduce adds up with the base's.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from tgi_kernels.native import native_ops

from ..distributed import TensorParallel
from ..weights.errors import CheckpointError
from ..weights.lora_adapters import Adapter

# Runs of at least this many rows go to torch's GEMMs on the CPU too: there they beat the
# C++ kernel on long prefills, while below it the GEMMs' fixed cost per call dominates
# (figures: docs/tuning.md#lora-kernel).
GEMM_ROWS = 64
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # csrc/lora.cpp's (float64 takes the GEMMs)
KERNEL_MAX_RANK = 1024  # csrc/lora.cpp's kMaxRank: a layer's rank per adapter (a fused layer's parts summed)


class LoraBatch:
    """The current step's tokens grouped by adapter: segments = [(adapter
    index (1-based), first row, end row)], runs of the flat batch (which
    batch.build_batch orders by adapter: one run of decodes and one of
    prefills per adapter); empty when every token runs the base model.
    short: those of fewer than GEMM_ROWS rows as int64 [S, 3] (the C++
    kernel's); long: the others."""

    def __init__(self):
        self.segments: list[tuple[int, int, int]] = []
        self.short = torch.empty(0, 3, dtype=torch.int64)
        self.long: list[tuple[int, int, int]] = []


class AdapterSet:
    """The loaded adapters (index i + 1 is adapters[i]; 0 is the base
    model), as the layers slice them, and the step's LoraBatch they share."""

    def __init__(self, adapters: list[Adapter]):
        self.adapters = adapters
        self.batch = LoraBatch()
        self._used: set[tuple[int, str]] = set()

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.adapters]

    def targets(self, module: str) -> bool:
        return any(module in a.modules for a in self.adapters)

    def column(self, module: str, start: int, stop: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """(index, A [r, in], scale * B rows [start, stop) [stop - start, r]) per adapter targeting `module`."""
        return [(i, m.a, m.b[start:stop] * m.scale) for i, m in self._modules(module)]

    def row(self, module: str, start: int, stop: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """(index, A columns [start, stop) [r, stop - start], scale * B [out, r]) per adapter targeting `module`."""
        return [(i, m.a[:, start:stop], m.b * m.scale) for i, m in self._modules(module)]

    def _modules(self, module: str):
        for i, adapter in enumerate(self.adapters, start=1):
            if (m := adapter.modules.get(module)) is not None:
                self._used.add((i, module))
                yield i, m

    def check_all_used(self) -> None:
        """CheckpointError naming a module an adapter targets that the model never loaded."""
        for i, adapter in enumerate(self.adapters, start=1):
            unused = sorted(m for m in adapter.modules if (i, m) not in self._used)
            if unused:
                raise CheckpointError(f"LoRA adapter {adapter.name!r} targets {unused[0]}, which this model "
                                      "does not have as a linear layer (or serves fused in a way the adapter "
                                      "does not follow)")

    def set_segments(self, segments: list[tuple[int, int, int]]) -> None:
        """The step's (adapter index > 0, first row, end row) runs."""
        self.batch.segments = segments
        short = [r for r in segments if r[2] - r[1] < GEMM_ROWS]
        self.batch.short = torch.tensor(short, dtype=torch.int64).reshape(-1, 3)
        self.batch.long = [r for r in segments if r[2] - r[1] >= GEMM_ROWS]


class LoraLinear(nn.Module):
    """x [T, in] -> base(x) + on each adapter's runs of rows (x A^T) B^T,
    then the all-reduce of a row-parallel layer (reduce) if any.

    deltas: adapter index -> (A [R, in], B [out, R]) with the scale folded
    into B. A fused layer (q/k/v, gate/up) stacks the A of every part the
    adapter targets (R = the sum of their ranks) and places each part's B
    in its own output rows and rank columns (zeros elsewhere): one pair of
    products per run whichever parts it targets. Every adapter's rows are
    kept in one A [sum R, in] and one B^T [sum R, out], adapter i's at
    offsets[i - 1]:offsets[i]. On the CPU the C++ kernel takes all runs
    shorter than GEMM_ROWS in one call; longer ones, and every run
    elsewhere, are a GEMM pair each, the second an addmm into the output
    rows in place. (Stacking every adapter's A and masking each
    row's columns instead, two GEMMs for all adapters at once, was slower:
    the masked GEMMs do the arithmetic of every adapter on every row, which
    at these sizes costs more than the calls; docs/tuning.md#lora-kernel.)"""

    def __init__(self, base: nn.Module, deltas: dict[int, tuple[torch.Tensor, torch.Tensor]], adapters: int,
                 batch: LoraBatch, reduce: TensorParallel | None, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.base = base
        self.batch = batch
        self.reduce = reduce
        ranks = [deltas[i][0].shape[0] if i in deltas else 0 for i in range(1, adapters + 1)]
        self.offsets = [0, *itertools.accumulate(ranks)]
        self.offset_table = torch.tensor(self.offsets, dtype=torch.int64)
        # Plain tensors, not parameters: the adapters are not the model's weights.
        ordered = [deltas[i] for i in range(1, adapters + 1) if i in deltas]
        # [sum R, in] and [sum R, out]; None where no adapter targets the layer (a row-parallel one keeps its reduce)
        self.a = torch.cat([a for a, _ in ordered]).to(device, dtype).contiguous() if ordered else None
        self.bt = torch.cat([b.t() for _, b in ordered]).to(device, dtype).contiguous() if ordered else None
        fits = device.type == "cpu" and dtype in KERNEL_DTYPES and max(ranks, default=0) <= KERNEL_MAX_RANK
        self.native = native_ops() if fits else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.a is not None and self.batch.segments:
            runs = self.batch.segments
            if self.native is not None and x.stride(-1) == 1 and y.stride(-1) == 1:
                if len(self.batch.short):
                    self.native.lora_add_(y, x, self.a, self.bt, self.offset_table, self.batch.short)
                runs = self.batch.long
            for index, start, stop in runs:
                first, end = self.offsets[index - 1], self.offsets[index]
                if end > first:  # += (x A^T) B^T: [n, R], then [n, out]
                    y[start:stop].addmm_(x[start:stop] @ self.a[first:end].t(), self.bt[first:end])
        return y if self.reduce is None else self.reduce.all_reduce_sum(y)


def column_lora(base: nn.Module, lora: AdapterSet, parts: list[tuple[str, int, int]], dtype: torch.dtype,
                device: torch.device) -> nn.Module:
    """`base`, the column-parallel concatenation of `parts` (module, start,
    stop), with the deltas of the adapters that target any of them."""
    pieces: dict[int, list[tuple[torch.Tensor, torch.Tensor, int]]] = {}
    first = 0
    for module, start, stop in parts:
        for index, a, b in lora.column(module, start, stop):
            pieces.setdefault(index, []).append((a, b, first))
        first += stop - start
    deltas = {}
    for index, targeted in pieces.items():
        a = torch.cat([a for a, _, _ in targeted])                   # [R, in]
        b = torch.zeros(first, a.shape[0])                           # [out, R]
        rank = 0
        for part_a, part_b, row in targeted:
            b[row:row + part_b.shape[0], rank:rank + part_a.shape[0]] = part_b
            rank += part_a.shape[0]
        deltas[index] = (a, b)
    return LoraLinear(base, deltas, len(lora.adapters), lora.batch, None, dtype, device) if deltas else base


def row_lora(base: nn.Module, lora: AdapterSet, module: str, start: int, stop: int,
             reduce: TensorParallel | None, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """`base` (built without its all-reduce), this rank's input columns
    [start, stop) of `module`, with the adapters' deltas and then `reduce`."""
    deltas = {index: (a, b) for index, a, b in lora.row(module, start, stop)}
    return LoraLinear(base, deltas, len(lora.adapters), lora.batch, reduce, dtype, device)
