"""Many LoRA adapters in one batch (multi-LoRA serving, as TGI's --lora-adapters).

Every linear that some adapter targets becomes a LoraLinear: the base layer
(dense or quantized) on all tokens, then, for each adapter that the step's
tokens use, its low-rank delta on that adapter's tokens only. The step's
batch lists its sequences grouped by adapter (batch.build_batch), so an
adapter's tokens are one or two contiguous runs of rows (its decodes, its
prefills): per run, one GEMM x A^T and one addmm of B into the output
rows, in place; nothing loops over tokens or gathers them.

Tensor parallelism: a column-parallel layer (q/k/v, gate/up: rows of the
output split over the ranks) keeps A whole and its rows of B; a
row-parallel one (o_proj, down_proj: input columns split) keeps its columns
of A and B whole, so each rank's delta is a partial sum that the layer's
one all-reduce adds up with the base's.
"""

from __future__ import annotations

import torch
from torch import nn

from ..distributed import TensorParallel
from ..weights.errors import CheckpointError
from ..weights.lora_adapters import Adapter


class LoraBatch:
    """The current step's tokens grouped by adapter: segments = [(adapter
    index (1-based), first row, end row)], runs of the flat batch (which
    batch.build_batch orders by adapter: one run of decodes and one of
    prefills per adapter); empty when every token runs the base model."""

    def __init__(self):
        self.segments: list[tuple[int, int, int]] = []


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


class LoraLinear(nn.Module):
    """x [T, in] -> base(x) + on each adapter's runs of rows (x A^T) B^T,
    then the all-reduce of a row-parallel layer (reduce) if any.

    deltas: adapter index -> (A [R, in], B [out, R]) with the scale folded
    into B. A fused layer (q/k/v, gate/up) stacks the A of every part the
    adapter targets (R = the sum of their ranks) and places each part's B
    in its own output rows and rank columns (zeros elsewhere): one pair of
    GEMMs per run whichever parts it targets, the second an addmm into the
    output rows in place. (Stacking every adapter's A and masking each
    row's columns instead, two GEMMs for all adapters at once, measured
    1.4x slower at 4 adapters of rank 16 on SmolLM2: the masked GEMMs do
    4x the arithmetic, which at these sizes costs more than the calls.)"""

    def __init__(self, base: nn.Module, deltas: dict[int, tuple[torch.Tensor, torch.Tensor]], adapters: int,
                 batch: LoraBatch, reduce: TensorParallel | None, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.base = base
        self.batch = batch
        self.reduce = reduce
        # By adapter index (0, the base, and adapters not targeting this layer: None). Plain
        # tensors, not parameters: the adapters are not the model's weights.
        self.deltas: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * (adapters + 1)
        for i, (a, b) in deltas.items():
            self.deltas[i] = (a.to(device, dtype).contiguous(), b.t().to(device, dtype).contiguous())  # A, B^T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for index, start, stop in self.batch.segments:
            if (delta := self.deltas[index]) is not None:
                a, bt = delta
                y[start:stop].addmm_(x[start:stop] @ a.t(), bt)  # += (x A^T) B^T: [n, R], then [n, out]
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
