"""Every attention backend agrees with the reference, and the reference with a naive oracle."""

import pytest
import torch

from tgi_kernels import SOFTCAP_BACKENDS, available_backends, paged_decode, varlen_prefill

from .kernel_cases import make_case, make_decode_case, naive_attention

CPU = torch.device("cpu")
# triton runs its own sweep of representative shapes (test_triton_kernels.py): the
# interpreter is too slow for this full product.
FAST_CPU_BACKENDS = [b for b in available_backends(CPU) if b not in ("reference", "triton")]
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}

# (query_lens, prefix_lens, block_size): ragged lengths including 1, crossing block boundaries.
PREFILL_SCENARIOS = {
    "fresh": ([1, 7, 16, 17, 33], [0, 0, 0, 0, 0], 16),
    "chunked": ([5, 16, 1, 9, 3], [3, 16, 40, 0, 1], 4),
    "chunked_bs16": ([20, 1, 16], [17, 31, 16], 16),
    # several tiles of query rows (the cpu kernel's 8 or 16), prefixes over several blocks
    "long_bs32": ([100, 37], [45, 0], 32),
}
# (seq_lens, block_size)
DECODE_SCENARIOS = {
    "bs16": ([1, 2, 15, 16, 17, 40, 100], 16),
    "bs4": ([1, 3, 4, 5, 9, 30], 4),
    "bs32": ([1, 17, 31, 32, 33, 70], 32),  # chunks of 16 tokens inside a block
}


# --- the reference against a hand-written softmax ---------------------------------


@pytest.mark.parametrize("sliding_window, softcap", [(0, 0.0), (3, 0.0), (3, 0.5)])
def test_reference_prefill_matches_naive_dense_attention(sliding_window, softcap):
    case = make_case([4, 3], [0, 5], heads=4, kv_heads=2, head_dim=8, block_size=2, seed=1)
    out = varlen_prefill(
        case.query, case.key, case.value, case.k_cache, case.v_cache, case.prefill,
        scale=0.3, sliding_window=sliding_window, backend="reference", softcap=softcap,
    )
    start = 0
    for n, prefix, k, v in zip(case.query_lens, case.prefix_lens, case.contexts_k, case.contexts_v):
        positions = list(range(prefix, prefix + n))
        want = naive_attention(case.query[start : start + n], k, v, positions, 0.3, sliding_window, softcap)
        torch.testing.assert_close(out[start : start + n].double(), want, atol=1e-5, rtol=1e-5)
        start += n


@pytest.mark.parametrize("sliding_window, softcap", [(0, 0.0), (3, 0.0), (3, 0.5)])
def test_reference_decode_matches_naive_dense_attention(sliding_window, softcap):
    case = make_decode_case([1, 5, 8], heads=6, kv_heads=2, head_dim=8, block_size=2, seed=2)
    out = paged_decode(
        case.query, case.k_cache, case.v_cache, case.decode,
        scale=0.3, sliding_window=sliding_window, backend="reference", softcap=softcap,
    )
    for b, (k, v) in enumerate(zip(case.contexts_k, case.contexts_v)):
        want = naive_attention(case.query[b : b + 1], k, v, [k.shape[0] - 1], 0.3, sliding_window, softcap)
        torch.testing.assert_close(out[b : b + 1].double(), want, atol=1e-5, rtol=1e-5)


# --- fast backends against the reference ------------------------------------------


def _check_prefill(backend, scenario, group, head_dim, sliding_window, dtype, device, softcap=0.0):
    query_lens, prefix_lens, block_size = PREFILL_SCENARIOS[scenario]
    case = make_case(
        query_lens, prefix_lens, heads=2 * group, kv_heads=2, head_dim=head_dim,
        block_size=block_size, dtype=dtype, device=device, seed=group + head_dim,
    )
    args = (case.query, case.key, case.value, case.k_cache, case.v_cache, case.prefill, head_dim**-0.5)
    want = varlen_prefill(*args, sliding_window=sliding_window, backend="reference", softcap=softcap)
    got = varlen_prefill(*args, sliding_window=sliding_window, backend=backend, softcap=softcap)
    assert got.shape == case.query.shape and got.dtype == dtype
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


def _check_decode(backend, scenario, group, head_dim, sliding_window, dtype, device, softcap=0.0):
    seq_lens, block_size = DECODE_SCENARIOS[scenario]
    case = make_decode_case(
        seq_lens, heads=2 * group, kv_heads=2, head_dim=head_dim,
        block_size=block_size, dtype=dtype, device=device, seed=group * head_dim,
    )
    args = (case.query, case.k_cache, case.v_cache, case.decode, head_dim**-0.5)
    want = paged_decode(*args, sliding_window=sliding_window, backend="reference", softcap=softcap)
    got = paged_decode(*args, sliding_window=sliding_window, backend=backend, softcap=softcap)
    assert got.shape == case.query.shape and got.dtype == dtype
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


# (GQA ratio, head dim): every ratio and every head dim, without the full product.
SHAPES = pytest.mark.parametrize("group, head_dim", [(1, 64), (3, 64), (3, 128), (8, 128)])
WINDOWS = pytest.mark.parametrize("sliding_window", [0, 6])
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@pytest.mark.parametrize("backend", FAST_CPU_BACKENDS)
@pytest.mark.parametrize("scenario", list(PREFILL_SCENARIOS))
@SHAPES
@WINDOWS
@DTYPES
def test_prefill_backend_matches_reference(backend, scenario, group, head_dim, sliding_window, dtype):
    _check_prefill(backend, scenario, group, head_dim, sliding_window, dtype, "cpu")


@pytest.mark.parametrize("backend", FAST_CPU_BACKENDS)
@pytest.mark.parametrize("scenario", list(DECODE_SCENARIOS))
@SHAPES
@WINDOWS
@DTYPES
def test_decode_backend_matches_reference(backend, scenario, group, head_dim, sliding_window, dtype):
    _check_decode(backend, scenario, group, head_dim, sliding_window, dtype, "cpu")


# gemma2's soft cap on the scores (1.5: the random cases' scores reach past it)
@pytest.mark.parametrize("backend", [b for b in FAST_CPU_BACKENDS if b in SOFTCAP_BACKENDS])
@pytest.mark.parametrize("scenario", list(PREFILL_SCENARIOS))
@SHAPES
@DTYPES
def test_prefill_backend_caps_scores_as_the_reference(backend, scenario, group, head_dim, dtype):
    _check_prefill(backend, scenario, group, head_dim, 6, dtype, "cpu", softcap=1.5)


@pytest.mark.parametrize("backend", [b for b in FAST_CPU_BACKENDS if b in SOFTCAP_BACKENDS])
@pytest.mark.parametrize("scenario", list(DECODE_SCENARIOS))
@SHAPES
@DTYPES
def test_decode_backend_caps_scores_as_the_reference(backend, scenario, group, head_dim, dtype):
    _check_decode(backend, scenario, group, head_dim, 6, dtype, "cpu", softcap=1.5)


# --- behaviours that hold for every backend -----------------------------------------


@pytest.mark.parametrize("backend", available_backends(CPU))
@WINDOWS
def test_decode_equals_prefill_of_one_token_after_the_cached_context(backend, sliding_window):
    case = make_decode_case([1, 9, 33], heads=6, kv_heads=2, head_dim=16, block_size=4, seed=3)
    scale = 0.25
    decoded = paged_decode(
        case.query, case.k_cache, case.v_cache, case.decode, scale, sliding_window, backend=backend
    )
    prefilled = varlen_prefill(
        case.query, case.key, case.value, case.k_cache, case.v_cache, case.prefill,
        scale, sliding_window, backend=backend,
    )
    torch.testing.assert_close(decoded, prefilled, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", available_backends(CPU))
def test_prefill_without_prefix_does_not_read_the_cache(backend):
    case = make_case([3, 8], [0, 0], heads=4, kv_heads=1, head_dim=16, block_size=4, seed=4)
    scale = 0.25
    want = varlen_prefill(
        case.query, case.key, case.value, case.k_cache, case.v_cache, case.prefill, scale, backend=backend
    )
    poisoned = torch.full_like(case.k_cache, float("nan"))
    got = varlen_prefill(
        case.query, case.key, case.value, poisoned, poisoned, case.prefill, scale, backend=backend
    )
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", available_backends(CPU))
def test_sliding_window_limits_what_a_query_sees(backend):
    # With a window of 1 a token attends only to itself: the output is its own value.
    case = make_decode_case([5, 12], heads=2, kv_heads=2, head_dim=8, block_size=4, seed=5)
    out = paged_decode(case.query, case.k_cache, case.v_cache, case.decode, 1.0, 1, backend=backend)
    torch.testing.assert_close(out, torch.stack([v[-1] for v in case.contexts_v]))


# --- CUDA: every available backend, including flash_attn ---------------------------

CUDA_BACKENDS = (
    [b for b in available_backends(torch.device("cuda")) if b != "reference"]
    if torch.cuda.is_available()
    else []
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("scenario", list(PREFILL_SCENARIOS))
@SHAPES
@WINDOWS
@DTYPES
def test_cuda_prefill_backend_matches_reference(backend, scenario, group, head_dim, sliding_window, dtype):
    _check_prefill(backend, scenario, group, head_dim, sliding_window, dtype, "cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("scenario", list(DECODE_SCENARIOS))
@SHAPES
@WINDOWS
@DTYPES
def test_cuda_decode_backend_matches_reference(backend, scenario, group, head_dim, sliding_window, dtype):
    _check_decode(backend, scenario, group, head_dim, sliding_window, dtype, "cuda")
