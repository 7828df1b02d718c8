// float32 GEMM for the dense linears: y [M, N] = x [M, K] @ w.T (+ bias).
//
// Layout (layers/linear.py's pack_f32_lanes builds it at load):
//   w  [B, K, 16] float, B = ceil(N / 16): (b, k, j) holds w[16 b + j, k];
//      rows past N are zero.
// One 64-byte line is then column k of 16 output rows: one Lanes
// (lanes.h), multiplied by x[m, k] broadcast. A tile of MR rows of x by NB
// blocks keeps MR x NB accumulators in registers and reads each weight line
// once for all MR rows; a thread keeps its blocks (K * 64 bytes each) in
// L1/L2 while every MR rows of x pass over them. The weights are laid out
// once, at load, so no call repacks them (oneDNN's and MKL's GEMMs pack
// their operands per call, which dominates at a few dozen rows). Each output
// sums over K in order 0..K-1 in one chain whatever M is, so a sequence's
// logits do not depend on the batch it is in.
#include "common.h"
#include "lanes.h"
#include "steal.h"

namespace tgi {
namespace {

using namespace lanes16;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr int kTileRows = 8, kTileBlocks = 2;  // 16 zmm accumulators of 32
#else
constexpr int kTileRows = 6, kTileBlocks = 1;  // AVX2: 12 ymm accumulators of 16
#endif

// The first `valid` (<= 16) floats of bias as lanes, the rest zero.
inline Lanes bias_lanes(const float* bias, int64_t valid) {
  if (valid == kLanes) return lanes(bias);
  alignas(64) float padded[kLanes] = {};
  std::memcpy(padded, bias, valid * sizeof(float));
  return lanes(padded);
}

// MR rows of x (row stride K) against NB consecutive blocks of w (each K * 16
// floats) -> y [MR rows of stride N] at columns n0.. (+ bias).
template <int MR, int NB>
void tile(const float* x, const float* w, const float* bias, int64_t K, int64_t N, int64_t n0, float* y) {
  Lanes acc[MR][NB];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 2
    for (int b = 0; b < NB; ++b) acc[m][b] = zero();
  const int64_t block = K * kLanes;
  for (int64_t k = 0; k < K; ++k) {
    Lanes wv[NB];
#pragma GCC unroll 2
    for (int b = 0; b < NB; ++b) {
      wv[b] = lanes(w + b * block + k * kLanes);
      // 32 lines (2 KB) ahead, into L2: into L1 (prefetcht0) they filled the
      // core's few L1 miss buffers (figures: docs/tuning.md#weight-prefetch-distance).
      __builtin_prefetch(w + b * block + (k + 32) * kLanes, 0, 2);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 2
      for (int b = 0; b < NB; ++b) acc[m][b] = fma(x[m * K + k], wv[b], acc[m][b]);
  }
#pragma GCC unroll 2
  for (int b = 0; b < NB; ++b) {
    const int64_t col = n0 + b * kLanes, valid = std::min(kLanes, N - col);
    if (bias) {  // once for the tile's rows
      const Lanes add_bias = bias_lanes(bias + col, valid);
      for (int m = 0; m < MR; ++m) acc[m][b] = add(acc[m][b], add_bias);
    }
    for (int m = 0; m < MR; ++m) store(y + m * N + col, acc[m][b], valid);
  }
}

void gemm(const float* x, const float* w, const float* bias, int64_t M, int64_t K, int64_t N, int64_t blocks,
          float* y) {
  if (M == 0) return;  // (a step in which no sequence samples has no logits rows)
  const int64_t units = (blocks + kTileBlocks - 1) / kTileBlocks;
  parallel_steal(units, [&](int64_t u) {
    const int64_t b = u * kTileBlocks, nb = std::min<int64_t>(kTileBlocks, blocks - b);
    const float* wb = w + b * K * kLanes;
    // The first tile takes kTileRows rows: it reads the block from memory,
    // and more rows give its loads more time; the rest are dealt evenly
    // over the fewest tiles (32 rows: 6, 6, 5, 5, 5, 5, not 6 x 5 + 2), as
    // a tile of 5 rows runs about as long as one of 6 (from cache), and
    // one of 2 keeps too few multiply-add chains in flight.
    const int64_t rest = std::max<int64_t>(0, M - kTileRows), tiles = 1 + (rest + kTileRows - 1) / kTileRows;
    for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
      const int rows = int(t == 0 ? std::min<int64_t>(M, kTileRows)
                                  : rest / (tiles - 1) + (t - 1 < rest % (tiles - 1)));
      with_rows<kTileRows>(rows, [&](auto mr) {
        if constexpr (kTileBlocks == 2) {
          if (nb == 2) return tile<mr.value, 2>(x + m0 * K, wb, bias, K, N, b * kLanes, y + m0 * N);
        }
        tile<mr.value, 1>(x + m0 * K, wb, bias, K, N, b * kLanes, y + m0 * N);
      });
      m0 += rows;
    }
  });
}

}  // namespace

// x [M, K] float32 -> x @ w.T (+ bias) [M, n]; w in the layout above, bias [n] float32.
at::Tensor f32_mm(const at::Tensor& x, const at::Tensor& w, int64_t n, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous CPU [M, K] float32 tensor");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 3 && w.is_contiguous() && w.size(2) == kLanes &&
                  w.size(1) == x.size(1),
              "w must be contiguous [ceil(N / 16), K, 16] float32");
  const int64_t M = x.size(0), K = x.size(1), blocks = w.size(0);
  TORCH_CHECK(n > (blocks - 1) * kLanes && n <= blocks * kLanes, "n does not match the blocks");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(),
                "bias must be a contiguous [n] float32 tensor");
  auto y = at::empty({M, n}, x.options());
  gemm(x.const_data_ptr<float>(), w.const_data_ptr<float>(), bias.has_value() ? bias->const_data_ptr<float>() : nullptr,
       M, K, n, blocks, y.mutable_data_ptr<float>());
  return y;
}

}  // namespace tgi

TORCH_LIBRARY_FRAGMENT(tgi, m) {
  m.def("f32_mm(Tensor x, Tensor w, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tgi, CPU, m) {
  m.impl("f32_mm", tgi::f32_mm);
}
