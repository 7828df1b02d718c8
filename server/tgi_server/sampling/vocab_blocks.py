"""Row operations over a vocabulary cut into blocks of BLOCK logits.

On CPU, torch's argmax, topk and sort over a 50k vocabulary cost 2-5 ns per
logit, boolean masks and fresh full-size tensors about as much, while a
vectorized max or sum over contiguous blocks costs a tenth of that. So the
sampler reduces each row to per-block maxima (and exp-sums) once and then only
looks inside the few blocks that matter.

Temperature is folded in: the final logits of row i are x[i] / t[i]. Division
by t > 0 is monotonic under rounding, so block maxima of x divided by t are
exactly the block maxima of x / t.

Batch invariance: every reduction here yields one value per block (or sums a
short [R, NB] tensor), so each output is computed by the same loop whatever
the other rows; a whole-row reduction of a single row would instead be split
across threads and round differently than inside a batch."""

from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F

from tgi_kernels.native import native_ops

BLOCK = 64
NEG_INF = float("-inf")
CPU_CHUNK_ROWS = 4  # rows per exp pass on CPU, so that temporaries stay in cache
# Above this k, CPU sorts and topk go through numpy, whose vectorized sorts
# are faster than torch's on CPU (figures: docs/tuning.md#numpy-sorts).
_NUMPY_SORT_MIN_K = 16


def padded_width(vocab: int) -> int:
    return -(-vocab // BLOCK) * BLOCK


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """values as a 1-d tensor on `device`, without making the host wait for the
    device. On CUDA a copy from pageable memory blocks the host until every
    kernel queued before it has run (the step's whole forward), so that the
    sampler's later kernels would launch one by one after it, each a round
    trip: values go through pinned memory asynchronously instead, and an
    integer range is made on the device."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    if values and dtype == torch.int64 and values == list(range(values[0], values[0] + len(values))):
        return torch.arange(values[0], values[0] + len(values), device=device)
    # The caching host allocator keeps the pinned block until the copy has run.
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


def topk_desc(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of x [R, W], descending: (values [R, k], indices [R, k]).
    Ties come in no particular order."""
    if x.device.type != "cpu" or k <= _NUMPY_SORT_MIN_K:
        return x.topk(k, dim=1) if k < x.shape[1] else x.sort(dim=1, descending=True)
    neg = -x.numpy()
    if k < x.shape[1]:
        part = np.argpartition(neg, k - 1, axis=1)[:, :k]
        order = np.argsort(np.take_along_axis(neg, part, axis=1), axis=1)
        index = torch.from_numpy(np.take_along_axis(part, order, axis=1))
    else:
        index = torch.from_numpy(np.argsort(neg, axis=1))
    return x.gather(1, index), index


def greedy_rows(x: torch.Tensor, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The greedy choice of rows [R] (None: all) of x [B, V] (float32 or bf16,
    unit last stride) in one pass over each row (csrc/vocab.cpp): (the first
    index of each row's maximum [R] int64, its logsumexp [R] float32). None
    where our kernel does not run (off the CPU, no build): the caller then
    takes BlockedRows' way. A row's results depend on its logits alone, the
    same from bf16 logits as from their float32 copy."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.stride(1) != 1:
        return None
    ops = native_ops()
    return None if ops is None else ops.greedy_rows(x, rows)


def exp_rows(x: torch.Tensor) -> torch.Tensor:
    """exp of x [R, W], computed on rows padded to a multiple of BLOCK.

    On CPU, torch takes the elements left over after its last full vector
    through a scalar exp that may round differently; with whole blocks no
    element is left over, so a value's exp does not depend on where it sits."""
    pad = -x.shape[1] % BLOCK
    if pad == 0 or x.device.type != "cpu":
        return x.exp()
    return F.pad(x, (0, pad)).exp()[:, :x.shape[1]]


def argsort_rows(x: torch.Tensor) -> torch.Tensor:
    """Indices sorting each row of x [R, W] ascending: [R, W] int64."""
    if x.device.type != "cpu":
        return x.argsort(dim=1)
    return torch.from_numpy(np.argsort(x.numpy(), axis=1))


class BlockedRows:
    """Logits x [B, W] float32 (W = padded_width(vocab), -inf past the vocabulary),
    divided by per-row temperatures t [B, 1] (None: all 1), seen as [B, NB, BLOCK].

    chunk: a reusable float32 buffer of at least CPU_CHUNK_ROWS * W elements
    (unused off CPU)."""

    def __init__(self, x: torch.Tensor, vocab: int, temperature: torch.Tensor | None,
                 chunk: torch.Tensor):
        self.x, self.vocab, self.temperature, self.chunk = x, vocab, temperature, chunk
        self.blocks = x.view(x.shape[0], -1, BLOCK)  # [B, NB, BLOCK]

    # The block maxima are a pass over every row: made when first asked for
    # (greedy rows on our kernel never ask).
    @cached_property
    def raw_bmax(self) -> torch.Tensor:
        """[B, NB] block maxima of x."""
        return self.blocks.amax(dim=2)

    @cached_property
    def bmax(self) -> torch.Tensor:
        """[B, NB] block maxima of the final logits."""
        return self.raw_bmax if self.temperature is None else self.raw_bmax / self.temperature

    @cached_property
    def top(self) -> torch.Tensor:
        """[B] row maxima of the final logits."""
        return self.bmax.amax(dim=1)

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[1]

    def _scale(self, vals: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return vals if self.temperature is None else vals / self.temperature[rows]

    def argmax(self, rows: torch.Tensor) -> torch.Tensor:
        """First index of each row's maximum: [R] int64."""
        _, block = self.raw_bmax[rows].max(dim=1)  # [R]
        return block * BLOCK + self.blocks[rows, block].argmax(dim=1)

    def values(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Final logits at ids [R, n] of rows [R]: [R, n]."""
        return self._scale(self.x[rows.unsqueeze(1), ids], rows)

    def exp_block_sums(self, rows: torch.Tensor | None) -> torch.Tensor:
        """sum(exp(logit - row max)) of every block of rows [R] (None: all): [R, NB] float32.
        On CPU our kernel does it in one pass (csrc/vocab.cpp), with its own
        exp: sums differ from torch's in the last bits, the same whatever the batch."""
        ops = native_ops() if self.x.device.type == "cpu" else None
        if ops is not None and hasattr(ops, "exp_block_sums"):
            t = None if self.temperature is None else self.temperature.reshape(-1).contiguous()
            return ops.exp_block_sums(self.x, self.top.contiguous(), t, rows, BLOCK)
        n, width = (self.x.shape[0] if rows is None else len(rows)), self.x.shape[1]
        out = torch.empty(n, self.num_blocks, dtype=self.x.dtype, device=self.x.device)
        on_cpu = self.x.device.type == "cpu"
        step = CPU_CHUNK_ROWS if on_cpu else n
        for i in range(0, n, step):
            count = min(step, n - i)
            e = (self.chunk[:count * width] if on_cpu else self.x.new_empty(count * width)
                 ).view(count, width)
            if rows is None:  # a slice saves the copy
                sel, src = slice(i, i + count), self.x[i:i + count]
            else:
                sel = rows[i:i + count]
                src = torch.index_select(self.x, 0, sel, out=e)
            if self.temperature is not None:
                src = torch.div(src, self.temperature[sel], out=e)
            torch.sub(src, self.top[sel].unsqueeze(1), out=e).exp_()
            torch.sum(e.view(count, -1, BLOCK), dim=2, out=out[i:i + count])
        return out

    def log_normalizers(self, rows: torch.Tensor | None) -> torch.Tensor:
        """logsumexp of the final logits of rows [R] (None: all): [R] float32."""
        total = self.exp_block_sums(rows).double().sum(dim=1)
        return (self.top if rows is None else self.top[rows]) + total.log().float()

    def gather(self, rows: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Final logits of blocks [R, M] of rows [R]: (logits [R, M*BLOCK], ids [R, M*BLOCK])."""
        vals = self._scale(self.blocks[rows.unsqueeze(1), block_ids].flatten(1), rows)
        offsets = torch.arange(BLOCK, device=block_ids.device)
        ids = (block_ids.unsqueeze(2) * BLOCK + offsets).flatten(1)
        return vals, ids

    def top_n(self, rows: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The n largest final logits of rows [R], descending: (logits [R, n], ids [R, n])."""
        n = min(n, self.vocab)
        # The n largest logits lie in the n blocks with the largest maxima.
        blocks = self.raw_bmax[rows].topk(min(n, self.num_blocks), dim=1).indices  # [R, n]
        vals, ids = self.gather(rows, blocks)
        best = vals.topk(n, dim=1)
        return best.values, ids.gather(1, best.indices)

    def head(self, rows: torch.Tensor, num_blocks: int, keep: int | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Candidates of rows [R] from their num_blocks best blocks.

        Returns (logits [R, W], ids [R, W], bound [R]): every final logit of the
        row above bound is among the candidates (bound is -inf when all blocks
        are). keep: sort descending and keep the `keep` largest; None: leave in
        vocabulary order."""
        if num_blocks >= self.num_blocks:
            vals = self._scale(self.x.index_select(0, rows), rows)  # [R, W]
            ids = torch.arange(vals.shape[1], device=vals.device).expand_as(vals)
            bound = torch.full((len(rows),), NEG_INF, device=vals.device)
        else:
            order = self.bmax[rows].topk(num_blocks + 1, dim=1)  # [R, M + 1]
            bound = order.values[:, num_blocks]
            vals, ids = self.gather(rows, order.indices[:, :num_blocks].sort(dim=1).values)
        if keep is not None:
            vals, best = topk_desc(vals, min(keep, vals.shape[1]))
            ids = ids.gather(1, best)
        return vals, ids, bound
