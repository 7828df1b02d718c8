// 8-bit weight GEMV with one scale per group of columns, for GGUF's Q8_0
// (w[n, k] = d[n, g] * q[n, k], q int8, groups of 32 columns): the LM head of
// the default model (SmolLM2's tied token embedding is Q8_0). The dense bf16
// head reads 56 MB a token and took ~3.7 ms a step at one row on a 2-core
// Zen 4; this reads 30 MB.
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
#include "common.h"
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

template <typename T>
void gemv(const T* x, const int8_t* q, const float* scales, const Int8Shape& s, T* y) {
  std::vector<float> xf(s.M * s.K);  // x in float, once for every block
  for (int64_t i = 0; i < s.M * s.K; ++i) xf[i] = ld(x[i]);
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
        with_rows<kMaxRows>(rows, [&](auto mr) {
          gemv_block<mr.value>(qb, scales + b * s.G * kLanes, next_q, xf.data() + m0 * s.K, s, out);
        });
        for (int m = 0; m < rows; ++m) store(y + (m0 + m) * s.N + n0, out[m], valid);
      }
    }
  });
}

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

}  // namespace tgi

TORCH_LIBRARY_FRAGMENT(tgi, m) {
  m.def("int8_gemv(Tensor x, Tensor q, Tensor scales, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(tgi, CPU, m) {
  m.impl("int8_gemv", tgi::int8_gemv);
}
