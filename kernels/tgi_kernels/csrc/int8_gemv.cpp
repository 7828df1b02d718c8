// 8-bit weight GEMV with one scale per group of columns, for GGUF's Q8_0
// (w[n, k] = d[n, g] * q[n, k], q int8, groups of 32 columns): the LM head of
// the default model (SmolLM2's tied token embedding is Q8_0). The dense bf16
// head reads 56 MB a token; this reads 30 MB (figures:
// docs/tuning.md#grouped-int8-head).
//
// Layout (quant/int8_lanes.py builds it at load):
//   q       [B, K, 16] int8, B = ceil(N / 16): byte (b, k, j) is q[16 b + j, k];
//           rows past N are zero.
//   scales  [B, G, 16] float32: (b, g, j) the scale of row 16 b + j in group g,
//           a group being K / G consecutive columns (a multiple of 4).
// Sixteen output rows fill one vector of float lanes (lanes.h): per column,
// one load, one widening, one multiply-add per row of x; the group's sum is
// scaled once. x is taken in float and q exactly, so float32 results equal
// the dequantized weight's GEMV up to the order of the additions.
//
// int8_gemv_int8x (AVX512-VNNI and -VBMI): x quantized to int8 per 32
// columns as the int4 GEMV's (int4_vnni.h), and the products summed in
// integers by vpdpbusd, 64 an instruction where the float kernel does 16.
// At 8 rows of SmolLM2's head the float kernel is bound by its
// multiply-adds (at one row it reads memory): the speculative verify steps
// (1 + drafts rows) and decode at a few streams pay that.
#include "common.h"
#include "int4_vnni.h"
#include "lanes.h"

#include <vector>

namespace tgi {
namespace {

using namespace lanes16;

struct Int8Shape {
  int64_t M, K, N, blocks, G, run;  // run: columns a group
};

Int8Shape check(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous CPU [M, K] tensor");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 3 && q.size(2) == kLanes && q.is_contiguous() &&
                  q.size(1) == x.size(1),
              "q must be contiguous [ceil(N / 16), K, 16] int8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 3 && scales.is_contiguous() &&
                  scales.size(0) == q.size(0) && scales.size(2) == kLanes,
              "scales must be contiguous [ceil(N / 16), G, 16] float32");
  const int64_t K = x.size(1), G = scales.size(1), blocks = q.size(0);
  TORCH_CHECK(G > 0 && K % G == 0 && (K / G) % 4 == 0, "groups must be runs of a multiple of 4 columns");
  TORCH_CHECK(n > (blocks - 1) * kLanes && n <= blocks * kLanes, "n does not match the blocks");
  return {x.size(0), K, n, blocks, G, K / G};
}

// MR rows of x (float, [MR, K]) against one block of 16 output rows. Each
// 64-byte line holds 4 columns; U sets of accumulators keep kChains
// multiply-add chains in flight even for one row. next_q: the next block,
// prefetched a line per line computed (the weights stream from memory).
template <int MR>
void gemv_block(const int8_t* q, const float* scales, const int8_t* next_q, const float* x, const Int8Shape& s,
                Lanes* out) {
  constexpr int U = MR >= kChains ? 1 : MR * 2 > kChains ? 2 : kChains / MR;  // 1, 2 or 4: divides 4
  Lanes total[MR];
  for (int m = 0; m < MR; ++m) total[m] = zero();
  for (int64_t g = 0; g < s.G; ++g) {
    Lanes acc[U][MR];
    for (int u = 0; u < U; ++u)
      for (int m = 0; m < MR; ++m) acc[u][m] = zero();
    for (int64_t k = g * s.run; k < (g + 1) * s.run; k += 4) {
      __builtin_prefetch(next_q + k * kLanes);
      for (int c = 0; c < 4; ++c) {
        const Lanes w = int8s(q + (k + c) * kLanes);
        for (int m = 0; m < MR; ++m) acc[c % U][m] = fma(x[m * s.K + k + c], w, acc[c % U][m]);
      }
    }
    const Lanes scale = lanes(scales + g * kLanes);
    for (int m = 0; m < MR; ++m) {
      Lanes sum = acc[0][m];
      for (int u = 1; u < U; ++u) sum = add(sum, acc[u][m]);
      total[m] = fma(sum, scale, total[m]);
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = total[m];
}

// Calls block(mr, qb, sb, next_q, m0, out) for every block of 16 output
// rows (qb its int8 values, sb its scales, next_q the next block's, to
// prefetch) and every kMaxRows rows of x (mr: their number, a constant),
// then stores out into y.
template <typename T, typename F>
void over_blocks(const int8_t* q, const float* scales, const Int8Shape& s, T* y, F&& block) {
  // A block is K * 16 bytes: at least ~64 KiB of them a thread.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 12) / s.K);
  at::parallel_for(0, s.blocks, grain, [&](int64_t begin, int64_t end) {
    Lanes out[kMaxRows];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kLanes, valid = std::min(kLanes, s.N - n0);
      const int8_t* qb = q + b * s.K * kLanes;
      const int8_t* next_q = b + 1 < s.blocks ? qb + s.K * kLanes : qb;
      for (int64_t m0 = 0; m0 < s.M; m0 += kMaxRows) {
        const int rows = int(std::min<int64_t>(kMaxRows, s.M - m0));
        with_rows<kMaxRows>(rows, [&](auto mr) { block(mr, qb, scales + b * s.G * kLanes, next_q, m0, out); });
        for (int m = 0; m < rows; ++m) store(y + (m0 + m) * s.N + n0, out[m], valid);
      }
    }
  });
}

template <typename T>
void gemv(const T* x, const int8_t* q, const float* scales, const Int8Shape& s, T* y) {
  std::vector<float> xf(s.M * s.K);  // x in float, once for every block
  for (int64_t i = 0; i < s.M * s.K; ++i) xf[i] = ld(x[i]);
  over_blocks(q, scales, s, y, [&](auto mr, auto qb, auto sb, auto next_q, int64_t m0, Lanes* out) {
    gemv_block<mr.value>(qb, sb, next_q, xf.data() + m0 * s.K, s, out);
  });
}

#ifdef TGI_INT4_VNNI
#define TGI_INT8_VNNI 1
using int4_vnni::kRun;

// MR rows of xq (int8, [MR, K], each 8 columns in int4_vnni's slot order:
// 0, 2, 4, 6, 1, 3, 5, 7) against one block of 16 output rows. vpdpbusd
// multiplies unsigned by signed bytes: w + 128 (w ^ 0x80) by x, so each
// run's sum starts at -128 * sum(xq over the run) (xqsum [MR, K / 32]) and
// stays exact in int32 (at most 32 * 255 * 128 a run). Two lines hold 8
// columns (byte 16 c + j: column c of row j); one two-source byte
// permutation gathers row j's even columns into 32-bit lane j, one its odd.
template <int MR>
void vnni_block(const int8_t* q, const float* scales, const int8_t* next_q, const int8_t* xq, const float* dx,
                const int32_t* xqsum, const Int8Shape& s, Lanes* out) {
  constexpr int A = MR == 1 ? 4 : MR == 2 ? 2 : 1;  // int32 chains a row: vpdpbusd's latency covered
  alignas(64) static const uint8_t order[2][64] = {
      {0, 32, 64, 96, 1, 33, 65, 97, 2, 34, 66, 98, 3, 35, 67, 99, 4, 36, 68, 100, 5, 37, 69, 101,
       6, 38, 70, 102, 7, 39, 71, 103, 8, 40, 72, 104, 9, 41, 73, 105, 10, 42, 74, 106, 11, 43, 75, 107,
       12, 44, 76, 108, 13, 45, 77, 109, 14, 46, 78, 110, 15, 47, 79, 111},
      {16, 48, 80, 112, 17, 49, 81, 113, 18, 50, 82, 114, 19, 51, 83, 115, 20, 52, 84, 116, 21, 53, 85, 117,
       22, 54, 86, 118, 23, 55, 87, 119, 24, 56, 88, 120, 25, 57, 89, 121, 26, 58, 90, 122, 27, 59, 91, 123,
       28, 60, 92, 124, 29, 61, 93, 125, 30, 62, 94, 126, 31, 63, 95, 127}};  // byte 4 j + i <- column 2 i (+ 1) of row j
  const __m512i even = _mm512_load_si512(order[0]), odd = _mm512_load_si512(order[1]);
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  const int64_t runs = s.K / kRun;
  __m512 total[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) total[m] = _mm512_setzero_ps();
  for (int64_t r = 0; r < runs; ++r) {
    __m512i acc[A][MR];
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      acc[0][m] = _mm512_set1_epi32(-128 * xqsum[m * runs + r]);
#pragma GCC unroll 4
      for (int a = 1; a < A; ++a) acc[a][m] = _mm512_setzero_si512();
    }
#pragma GCC unroll 4
    for (int u = 0; u < int(kRun / 8); ++u) {  // 8 columns: two lines
      const int64_t k = r * kRun + 8 * u;
      __builtin_prefetch(next_q + k * kLanes);
      __builtin_prefetch(next_q + (k + 4) * kLanes);
      const __m512i a0 = _mm512_loadu_si512(q + k * kLanes), a1 = _mm512_loadu_si512(q + (k + 4) * kLanes);
      const __m512i we = _mm512_xor_si512(_mm512_permutex2var_epi8(a0, even, a1), flip);
      const __m512i wo = _mm512_xor_si512(_mm512_permutex2var_epi8(a0, odd, a1), flip);
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const int8_t* xp = xq + m * s.K + k;  // slots 0-3: the even columns, 4-7: the odd
        acc[(2 * u) % A][m] = int4_vnni::dpbusd_broadcast(acc[(2 * u) % A][m], we, xp);
        acc[(2 * u + 1) % A][m] = int4_vnni::dpbusd_broadcast(acc[(2 * u + 1) % A][m], wo, xp + 4);
      }
    }
    const __m512 scale = _mm512_loadu_ps(scales + (r * kRun / s.run) * kLanes);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      __m512i sum = acc[0][m];
#pragma GCC unroll 4
      for (int a = 1; a < A; ++a) sum = _mm512_add_epi32(sum, acc[a][m]);
      total[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scale, _mm512_set1_ps(dx[m * runs + r])),
                                 total[m]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) out[m] = {total[m]};
}

template <typename T>
void gemv_int8x(const T* x, const int8_t* q, const float* scales, const Int8Shape& s, T* y) {
  const int64_t runs = s.K / kRun;
  std::vector<int8_t> xq(s.M * s.K);
  std::vector<float> dx(s.M * runs), xs(s.M * runs);
  std::vector<int32_t> xqsum(s.M * runs);
  int4_vnni::quantize(x, s.M, s.K, xq.data(), dx.data(), xs.data(), xqsum.data());
  over_blocks(q, scales, s, y, [&](auto mr, auto qb, auto sb, auto next_q, int64_t m0, Lanes* out) {
    vnni_block<mr.value>(qb, sb, next_q, xq.data() + m0 * s.K, dx.data() + m0 * runs, xqsum.data() + m0 * runs, s,
                         out);
  });
}
#endif

}  // namespace

// x [M, K] -> x @ w.T [M, N] in x's dtype.
at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t n) {
  const Int8Shape s = check(x, q, scales, n);
  auto y = at::empty({s.M, s.N}, x.options());
  TGI_DISPATCH_16_32(x.scalar_type(), "int8_gemv", [&] {
    gemv(x.const_data_ptr<scalar_t>(), q.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(), s,
         y.mutable_data_ptr<scalar_t>());
  });
  return y;
}

// True where int8_gemv_int8x can run: built with AVX512-VNNI and -VBMI.
bool int8_int8x_available() {
#ifdef TGI_INT8_VNNI
  return true;
#else
  return false;
#endif
}

// x [M, K] -> x @ w.T [M, N] in x's dtype, x quantized to int8 per row and
// 32 columns on the way: for activations that need not stay exact (bf16,
// fp16), as int4_gemv_int8x. Groups must be runs of a multiple of 32 columns.
at::Tensor int8_gemv_int8x(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t n) {
  const Int8Shape s = check(x, q, scales, n);
  TORCH_CHECK(int8_int8x_available(), "int8_gemv_int8x: no AVX512-VNNI here (see int8_int8x_available)");
  TORCH_CHECK(s.run % 32 == 0, "int8_gemv_int8x: groups must be runs of a multiple of 32 columns");
  auto y = at::empty({s.M, s.N}, x.options());
#ifdef TGI_INT8_VNNI
  TGI_DISPATCH_16_32(x.scalar_type(), "int8_gemv_int8x", [&] {
    gemv_int8x(x.const_data_ptr<scalar_t>(), q.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(), s,
               y.mutable_data_ptr<scalar_t>());
  });
#endif
  return y;
}

}  // namespace tgi

TORCH_LIBRARY_FRAGMENT(tgi, m) {
  m.def("int8_gemv(Tensor x, Tensor q, Tensor scales, int n) -> Tensor");
  m.def("int8_gemv_int8x(Tensor x, Tensor q, Tensor scales, int n) -> Tensor");
  m.def("int8_int8x_available() -> bool", tgi::int8_int8x_available);
}

TORCH_LIBRARY_IMPL(tgi, CPU, m) {
  m.impl("int8_gemv", tgi::int8_gemv);
  m.impl("int8_gemv_int8x", tgi::int8_gemv_int8x);
}
