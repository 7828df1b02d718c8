// bf16 GEMM for the dense linears on CPUs with AVX512-BF16 and no AMX (AMD
// Zen 4; on AMX, oneDNN's tile kernels are faster): y [M, N] = x [M, K] @ w.T
// (+ bias), products of bf16 pairs summed in float by vdpbf16ps.
//
// Layout (layers/linear.py's pack_bf16_lanes builds it at load):
//   w  [B, K / 2, 16, 2] bf16, B = ceil(N / 16): (b, p, j) holds w[16 b + j, 2 p]
//      and w[16 b + j, 2 p + 1]; rows past N are zero.
// One 64-byte line is then one column pair of 16 output rows, the operand
// vdpbf16ps wants, and x's pair is its embedded broadcast: a tile of up to 8
// rows of x by 32 output columns keeps 16 accumulators, and each line loaded
// serves every row. Each output sums over K in the same order whatever M is,
// so a sequence's logits do not depend on the batch it is in.
//
// Against oneDNN's prepacked bf16 GEMM (what Linear used), SmolLM2's 30
// layers + head, 2 threads, Zen 4, weights warm: 3.6 / 7.2 / 21.5 / 40.5 /
// 337 ms at 1 / 8 / 32 / 64 / 512 rows against 7.4 / 11.1 / 25.8 / 45.3 / 362.
#include "common.h"
#include "lanes.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define TGI_BF16_GEMM 1
#endif

namespace tgi {
namespace {

#ifdef TGI_BF16_GEMM
constexpr int64_t kLanes = 16, kRows = 8;

// acc += w . (the bf16 pair at x, broadcast), one vdpbf16ps with an embedded
// broadcast (GCC emits a separate broadcast for _mm512_set1_epi32).
inline __m512 dp(__m512 acc, __m512i w, const c10::BFloat16* x) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
}

// MR rows of x (row stride K) against NB consecutive blocks from w (each
// K * 16 elements); y gets the tile's [MR, NB * 16] outputs (valid columns
// of the last block only), bias added before rounding.
template <int MR, int NB>
void tile(const c10::BFloat16* x, const c10::BFloat16* w, const float* bias, int64_t K, int64_t N, int64_t n0,
          c10::BFloat16* y) {
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
  const int64_t block = K * kLanes;
  for (int64_t p = 0; p < K / 2; ++p) {
    __m512i wv[NB];
    for (int b = 0; b < NB; ++b) {
      wv[b] = _mm512_loadu_si512(w + b * block + p * 2 * kLanes);
      __builtin_prefetch(w + b * block + (p + 8) * 2 * kLanes);
    }
    for (int m = 0; m < MR; ++m)
      for (int b = 0; b < NB; ++b) acc[m][b] = dp(acc[m][b], wv[b], x + m * K + 2 * p);
  }
  for (int b = 0; b < NB; ++b) {
    const int64_t col = n0 + b * kLanes, valid = std::min(kLanes, N - col);
    const __mmask16 mask = __mmask16((1u << valid) - 1);
    const __m512 add = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) {
      const __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(acc[m][b], add));
      _mm256_mask_storeu_epi16(y + m * N + col, mask, (__m256i)v);
    }
  }
}

void gemm(const c10::BFloat16* x, const c10::BFloat16* w, const float* bias, int64_t M, int64_t K, int64_t N,
          int64_t blocks, c10::BFloat16* y) {
  // Pairs of blocks (32 columns) to the threads; an odd last block goes alone.
  at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = 2 * pair, n0 = b * kLanes;
      const c10::BFloat16* wb = w + b * K * kLanes;
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const int rows = int(std::min(kRows, M - m0));
        lanes16::with_rows<kRows>(rows, [&](auto mr) {
          if (b + 1 < blocks)
            tile<mr.value, 2>(x + m0 * K, wb, bias, K, N, n0, y + m0 * N);
          else
            tile<mr.value, 1>(x + m0 * K, wb, bias, K, N, n0, y + m0 * N);
        });
      }
    }
  });
}
#endif

}  // namespace

// True where bf16_mm can run: built with AVX512-BF16.
bool bf16_mm_available() {
#ifdef TGI_BF16_GEMM
  return true;
#else
  return false;
#endif
}

// x [M, K] bf16 -> x @ w.T (+ bias) [M, n] bf16; w in the layout above, bias [n] (any float dtype).
at::Tensor bf16_mm(const at::Tensor& x, const at::Tensor& w, int64_t n, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(bf16_mm_available(), "bf16_mm: no AVX512-BF16 here (see bf16_mm_available)");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous CPU [M, K] bf16 tensor");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 4 && w.is_contiguous() && w.size(2) == 16 &&
                  w.size(3) == 2 && w.size(1) * 2 == x.size(1),
              "w must be contiguous [ceil(N / 16), K / 2, 16, 2] bf16");
  const int64_t M = x.size(0), K = x.size(1), blocks = w.size(0);
  TORCH_CHECK(n > (blocks - 1) * 16 && n <= blocks * 16, "n does not match the blocks");
  at::Tensor b32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bias must be [n]");
    b32 = bias->to(at::kFloat).contiguous();
  }
  auto y = at::empty({M, n}, x.options());
#ifdef TGI_BF16_GEMM
  gemm(x.const_data_ptr<c10::BFloat16>(), w.const_data_ptr<c10::BFloat16>(),
       b32.defined() ? b32.const_data_ptr<float>() : nullptr, M, K, n, blocks, y.mutable_data_ptr<c10::BFloat16>());
#endif
  return y;
}

}  // namespace tgi

TORCH_LIBRARY_FRAGMENT(tgi, m) {
  m.def("bf16_mm(Tensor x, Tensor w, int n, Tensor? bias) -> Tensor", tgi::bf16_mm);
  m.def("bf16_mm_available() -> bool", tgi::bf16_mm_available);
}
