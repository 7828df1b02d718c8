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
// so a sequence's logits do not depend on the batch it is in. It beats
// oneDNN's prepacked bf16 GEMM (what Linear used) from 1 to 512 rows
// (figures: docs/tuning.md#bf16-gemm).
#include "common.h"
#include "lanes.h"
#include "bf16_tile.h"
#include "gated.h"
#include "steal.h"

namespace tgi {
namespace {

#ifdef TGI_BF16_GEMM
using bf16_tile::kLanes;
using bf16_tile::kRows;
using bf16_tile::tile;

// Row tiles a work item takes: x in chunks of about kChunkBytes, so that a
// chunk stays in the core's L2 while block after block runs over it. One
// item per block pair over all of x instead re-read x (4.7 MB at 4,096 rows
// of K = 576, 12.6 MB at K = 1,536) from L3 or memory for every pair
// (figures: docs/tuning.md#bf16-gemm-row-chunks). A chunk holds at
// least kMinChunkTiles tiles (128 rows): each chunk streams the weights
// again, and a decode step of up to 128 rows, whose time is the weights'
// reading at large K, stays one chunk.
constexpr int64_t kChunkBytes = 256 * 1024, kMinChunkTiles = 16;

inline int64_t chunk_tiles(int64_t K) { return std::max<int64_t>(kMinChunkTiles, kChunkBytes / (2 * K * kRows)); }

// x's row tiles in chunks of chunk_tiles(K): a work item runs chunk c's
// tiles [first(c), end(c)) against one pair of blocks. No rows: no chunks.
struct RowChunks {
  int64_t tiles, per, count;
  RowChunks(int64_t M, int64_t K)
      : tiles((M + kRows - 1) / kRows), per(std::max<int64_t>(1, std::min(tiles, chunk_tiles(K)))),
        count((tiles + per - 1) / per) {}
  int64_t first(int64_t c) const { return c * per; }
  int64_t end(int64_t c) const { return std::min(tiles, (c + 1) * per); }
};

void gemm(const c10::BFloat16* x, const c10::BFloat16* w, const float* bias, int64_t M, int64_t K, int64_t N,
          int64_t blocks, c10::BFloat16* y) {
  const RowChunks chunks(M, K);
  const int64_t pairs = (blocks + 1) / 2;
  // Items (chunk, pair of blocks: 32 columns) to the threads, chunk by
  // chunk; an odd last block goes alone.
  parallel_steal(chunks.count * pairs, [&](int64_t item) {
    const int64_t pair = item % pairs, c = item / pairs, t0 = chunks.first(c), t1 = chunks.end(c);
    const int64_t b = 2 * pair, n0 = b * kLanes;
    const c10::BFloat16* wb = w + b * K * kLanes;
    // The next pair of blocks (the last pair: none) loads while this one's
    // row tiles run (ahead_slice): it reached L2 only once the first tile
    // asked for it, with that tile's own 2 KB-ahead prefetch (figures:
    // docs/tuning.md#bf16-gemm-next-block-prefetch).
    const int64_t next = std::min<int64_t>(2, std::max<int64_t>(0, blocks - b - 2));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m0 = t * kRows;
      const int rows = int(std::min(kRows, M - m0));
      const bf16_tile::Ahead ahead = bf16_tile::ahead_slice(wb + 2 * K * kLanes, next, K, t - t0, t1 - t0);
      lanes16::with_rows<kRows>(rows, [&](auto mr) {
        if (b + 1 < blocks)
          tile<mr.value, 2>(x + m0 * K, wb, bias, K, N, n0, y + m0 * N, ahead);
        else
          tile<mr.value, 1>(x + m0 * K, wb, bias, K, N, n0, y + m0 * N, ahead);
      });
    }
  });
}

// y [M, n] = act(x @ gate.T + bias_gate) * (x @ up.T + bias_up), w holding
// gate's and up's blocks in turn (block 2 j = gate rows 16 j.., 2 j + 1 = up's
// same rows). Each tile's two sums are rounded to bf16 (+ bias) exactly as
// gemm stores them, then gated::row runs on them as silu_mul / gelu_tanh_mul
// would on gemm's output: the same bits without the [M, 2 n] intermediate
// written and read back, or its own pass over memory.
template <typename Act>
void gemm_gated(const c10::BFloat16* x, const c10::BFloat16* w, const float* bias, int64_t M, int64_t K, int64_t n,
                c10::BFloat16* y) {
  const RowChunks chunks(M, K);
  const int64_t pairs = n / kLanes;
  parallel_steal(chunks.count * pairs, [&](int64_t item) {
    const int64_t j = item % pairs, c = item / pairs, t0 = chunks.first(c), t1 = chunks.end(c);
    const c10::BFloat16* wb = w + 2 * j * K * kLanes;
    const int64_t next = j + 1 < pairs ? 2 : 0;
    const __m512 bias_gate = bias ? _mm512_loadu_ps(bias + j * kLanes) : _mm512_setzero_ps();
    const __m512 bias_up = bias ? _mm512_loadu_ps(bias + n + j * kLanes) : _mm512_setzero_ps();
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m0 = t * kRows;
      const int rows = int(std::min(kRows, M - m0));
      const bf16_tile::Ahead ahead = bf16_tile::ahead_slice(wb + 2 * K * kLanes, next, K, t - t0, t1 - t0);
      lanes16::with_rows<kRows>(rows, [&](auto mr) {
        constexpr int MR = mr.value;
        alignas(64) float sums[MR * 2 * kLanes];  // [MR][gate, up][16]
        bf16_tile::tile_sums<MR, 2>(x + m0 * K, wb, K, sums, ahead);
        for (int m = 0; m < MR; ++m) {
          // Rounded to bf16 as gemm stores them, then widened back: what
          // silu_mul / gelu_tanh_mul would read.
          const float* s = sums + m * 2 * kLanes;
          const __m512 gate = gated::widen((__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(s), bias_gate)));
          const __m512 up = gated::widen((__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(s + kLanes), bias_up)));
          _mm256_storeu_si256((__m256i*)(y + (m0 + m) * n + j * kLanes), (__m256i)gated::apply16<Act>(gate, up));
        }
      });
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

// x [M, K] bf16 -> act(x @ gate.T + bias[:n]) * (x @ up.T + bias[n:]) [M, n]
// bf16, n a multiple of 16; w the layout above over gate's and up's 16-row
// blocks in turn (2 n / 16 blocks: gate's first, up's first, gate's second,
// ...), bias [2 n] (gate's, then up's; any float dtype); act "silu" or
// "gelu_tanh". Equal, bit for bit, to silu_mul / gelu_tanh_mul of bf16_mm
// over the blocks in order gate's then up's.
at::Tensor bf16_mm_gated(const at::Tensor& x, const at::Tensor& w, int64_t n, const std::optional<at::Tensor>& bias,
                         const std::string& act) {
  TORCH_CHECK(bf16_mm_available(), "bf16_mm_gated: no AVX512-BF16 here (see bf16_mm_available)");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous CPU [M, K] bf16 tensor");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 4 && w.is_contiguous() && w.size(2) == 16 &&
                  w.size(3) == 2 && w.size(1) * 2 == x.size(1),
              "w must be contiguous [2 n / 16, K / 2, 16, 2] bf16");
  TORCH_CHECK(n % 16 == 0 && w.size(0) * 16 == 2 * n, "n must be a multiple of 16 and w hold 2 n rows");
  at::Tensor b32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == 2 * n, "bias must be [2 n]");
    b32 = bias->to(at::kFloat).contiguous();
  }
  auto y = at::empty({x.size(0), n}, x.options());
#ifdef TGI_BF16_GEMM
  gated::with_act(act, [&](auto a) {
    gemm_gated<decltype(a)>(x.const_data_ptr<c10::BFloat16>(), w.const_data_ptr<c10::BFloat16>(),
                            b32.defined() ? b32.const_data_ptr<float>() : nullptr, x.size(0), x.size(1), n,
                            y.mutable_data_ptr<c10::BFloat16>());
  });
#endif
  return y;
}

}  // namespace tgi

TORCH_LIBRARY_FRAGMENT(tgi, m) {
  m.def("bf16_mm(Tensor x, Tensor w, int n, Tensor? bias) -> Tensor");
  m.def("bf16_mm_gated(Tensor x, Tensor w, int n, Tensor? bias, str act) -> Tensor");
  m.def("bf16_mm_available() -> bool", tgi::bf16_mm_available);
}

TORCH_LIBRARY_IMPL(tgi, CPU, m) {
  m.impl("bf16_mm", tgi::bf16_mm);
  m.impl("bf16_mm_gated", tgi::bf16_mm_gated);
}
