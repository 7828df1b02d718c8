"""The multi-LoRA kernel (csrc/lora.cpp, `tgi::lora_add_`) against float64
torch: each segment's rows get their adapter's (x A^T) B^T, other rows stay
as they were, and a row's result depends on nothing but that row."""

import pytest
import torch

from tgi_kernels.native import native_ops

ops = native_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="the C++ CPU kernels did not build here")

RANKS = [4, 0, 12, 7]  # adapter 2 does not target the layer; 7 is not a multiple of 4


def case(dtype: torch.dtype, rows: int = 21, d_in: int = 72, d_out: int = 600, seed: int = 0):
    """(y, x, a, bt, offsets): y [rows, d_out], x [rows, d_in], every adapter's A and B^T stacked."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d_in, generator=g).to(dtype)
    y = torch.randn(rows, d_out, generator=g).to(dtype)
    a = torch.randn(sum(RANKS), d_in, generator=g).to(dtype) / d_in ** 0.5
    bt = torch.randn(sum(RANKS), d_out, generator=g).to(dtype)
    offsets = torch.tensor([0, *torch.tensor(RANKS).cumsum(0).tolist()])
    return y, x, a, bt, offsets


def reference(y, x, a, bt, offsets, segments) -> torch.Tensor:
    """y + on each segment's rows (x A_i^T) B_i^T, in float64."""
    want = y.to(torch.float64, copy=True)
    for i, first, end in segments:
        lo, hi = int(offsets[i - 1]), int(offsets[i])
        want[first:end] += x[first:end].double() @ a[lo:hi].double().t() @ bt[lo:hi].double()
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_each_segment_gets_its_adapters_delta_and_other_rows_stay(dtype):
    y, x, a, bt, offsets = case(dtype)
    # adapter 1 twice (its decodes and its prefills), 2 targets nothing here, 4 has 11 rows
    # (a block of 8 and one of 3); rows 0-1 and 20 run the base model.
    segments = [(1, 2, 4), (3, 4, 5), (2, 5, 7), (4, 7, 18), (1, 18, 20)]
    want = reference(y, x, a, bt, offsets, segments)
    got = y.clone()
    ops.lora_add_(got, x, a, bt, offsets, torch.tensor(segments))
    assert torch.equal(got[:2], y[:2]) and torch.equal(got[5:7], y[5:7]) and torch.equal(got[20:], y[20:])
    # One rounding of a float sum: within the dtype's half-ulp of the exact result, and a float32's sums' error.
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -10}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_a_rows_result_depends_on_that_row_alone():
    y, x, a, bt, offsets = case(torch.bfloat16, rows=40)
    whole, split = y.clone(), y.clone()
    ops.lora_add_(whole, x, a, bt, offsets, torch.tensor([(3, 0, 40)]))
    ops.lora_add_(split, x, a, bt, offsets, torch.tensor([(3, 0, 5), (3, 5, 6), (3, 6, 40)]))
    one_row = y[17:18].clone()
    ops.lora_add_(one_row, x[17:18], a, bt, offsets, torch.tensor([(3, 0, 1)]))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = y.clone()
        ops.lora_add_(serial, x, a, bt, offsets, torch.tensor([(3, 0, 40)]))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(whole, split) and torch.equal(whole, serial) and torch.equal(whole[17:18], one_row)


def test_strided_rows_and_an_empty_step():
    y, x, a, bt, offsets = case(torch.float32)
    wide = torch.randn(x.shape[0], 3 * x.shape[1])
    wide[:, 8:8 + x.shape[1]] = x
    strided = wide[:, 8:8 + x.shape[1]]  # rows 3 * d_in apart
    got, want = y.clone(), y.clone()
    ops.lora_add_(got, strided, a, bt, offsets, torch.tensor([(1, 0, 21)]))
    ops.lora_add_(want, x, a, bt, offsets, torch.tensor([(1, 0, 21)]))
    assert torch.equal(got, want)
    untouched = y.clone()
    ops.lora_add_(untouched, x, a, bt, offsets, torch.empty(0, 3, dtype=torch.int64))
    assert torch.equal(untouched, y)


def test_bad_segments_and_shapes_are_errors_not_reads_out_of_bounds():
    y, x, a, bt, offsets = case(torch.float32)
    for segment in [(0, 0, 2), (5, 0, 2), (1, 3, 2), (1, 0, 22)]:
        with pytest.raises(RuntimeError, match="outside the adapters or the rows"):
            ops.lora_add_(y, x, a, bt, offsets, torch.tensor([segment]))
    with pytest.raises(RuntimeError, match="rows must lie within"):  # adapter 1's rows past a's 23
        ops.lora_add_(y, x, a, bt, torch.tensor([0, 900, 4, 16, 23]), torch.tensor([(1, 0, 2)]))
    with pytest.raises(RuntimeError, match="offsets must run"):
        ops.lora_add_(y, x, a, bt, offsets[:-1], torch.tensor([(1, 0, 2)]))
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.lora_add_(y, x.half(), a, bt, offsets, torch.tensor([(1, 0, 2)]))
    with pytest.raises(RuntimeError, match="Double"):  # float64 models take torch's GEMMs (layers/lora.py)
        ops.lora_add_(y.double(), x.double(), a.double(), bt.double(), offsets, torch.tensor([(1, 0, 2)]))
