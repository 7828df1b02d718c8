// 4-bit weight GEMMs for QuantLinear on CPU: y [M, N] = x [M, K] @ w.T, with
// w[n, k] = q[n, k] * scale[n, g] + offset[n, g] kept as nibbles (g: the group
// of column k). They beat torch's `_weight_int4pack_mm_for_cpu` at one row and
// more so at 32, where torch's is slower than the dense GEMM: they read a
// quarter of the dense bytes (figures: docs/tuning.md#int4-gemm-kernels).
// (at::parallel_for spreads work over threads only where this file is
// compiled with -fopenmp; without it, one thread.)
//
// Layout (QuantLinear builds it at load):
//   packed        [B, K / 2, 16] uint8, B = ceil(N / 16): byte (b, p, j) holds
//                 q[16 b + j, 2 p] in its low nibble and q[16 b + j, 2 p + 1] in
//                 its high one; rows past N are zero.
//   scale_offset  [B, G, 2, 16] in x's dtype: (b, g, 0, j) the scale and
//                 (b, g, 1, j) the offset of row 16 b + j in group g; a group is
//                 K / G consecutive columns, a multiple of 32.
// Sixteen output rows side by side fill one 512-bit vector of float lanes, so
// that the kernels dequantize without transposing:
// - int4_gemv (a few rows): per group, sum x * q in float (q exact), then add
//   scale * that + offset * sum(x); one multiply-add per weight and row, x in
//   float, every dtype exact to float32 rounding.
// - int4_amx_mm (bf16, many rows): dequantizes 32 columns x 16 rows at a time
//   into an AMX tile in the pair-interleaved (VNNI) order the tile multiply
//   wants, kept per thread for the next 32 rows of x; weights rounded to bf16
//   once, products accumulated in float.
// - int4_dequant_mm (any other case): the whole weight dequantized into a
//   per-thread scratch [K, N] in x's dtype, then one at::mm (oneDNN / BLAS).
#include "bf16_tile.h"
#include "common.h"
#include "int4_vnni.h"
#include "lanes.h"
#include "steal.h"

#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define TGI_INT4_AMX 1
#endif

namespace tgi {
namespace {

using namespace lanes16;

struct Int4Shape {
  int64_t M, K, N, blocks, G, per;  // per: column pairs a group
};

Int4Shape check(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_offset, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous CPU [M, K] tensor");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == kLanes &&
                  packed.is_contiguous() && packed.size(1) * 2 == x.size(1),
              "packed must be contiguous [ceil(N / 16), K / 2, 16] uint8");
  TORCH_CHECK(scale_offset.scalar_type() == x.scalar_type() && scale_offset.dim() == 4 && scale_offset.is_contiguous() &&
                  scale_offset.size(0) == packed.size(0) && scale_offset.size(2) == 2 && scale_offset.size(3) == kLanes,
              "scale_offset must be contiguous [ceil(N / 16), G, 2, 16] in x's dtype");
  const int64_t K = x.size(1), G = scale_offset.size(1), blocks = packed.size(0);
  TORCH_CHECK(G > 0 && K % G == 0 && (K / G) % 32 == 0, "groups must be runs of a multiple of 32 columns");
  TORCH_CHECK(n > (blocks - 1) * kLanes && n <= blocks * kLanes, "n does not match the packed blocks");
  return {x.size(0), K, n, blocks, G, K / 2 / G};
}

// The kernels ask for the next block's bytes while they compute on this one:
// the weights stream from memory (53 MB for SmolLM2), and the hardware
// prefetcher alone did not keep ahead of the FMAs (figures:
// docs/tuning.md#int4-gemm-kernels). The prefetches sit in loops that
// compute: GCC 12 deletes a loop of prefetches alone.

// MR rows of x (float, [MR, K]) against one block of 16 output rows:
// out[m] lane j = sum_k x[m, k] w[16 b + j, k]. q: the block's [K / 2, 16]
// bytes; so: its [G, 2, 16] scales and offsets (next_q, next_so: the block's
// to prefetch); xsum [MR, G]: x summed over each group. U sets of
// accumulators take U column pairs at a time, so that kChains multiply-add
// chains are in flight even for one row.
template <typename T, int MR>
void gemv_block(const uint8_t* q, const T* so, const uint8_t* next_q, const T* next_so, const float* x,
                const float* xsum, const Int4Shape& s, Lanes* out) {
  constexpr int U = MR >= kChains ? 1 : MR * 2 > kChains ? 2 : kChains / MR;  // 1, 2 or 4: divides s.per
  Lanes total[MR];
  for (int m = 0; m < MR; ++m) total[m] = zero();
  for (int64_t g = 0; g < s.G; ++g) {
    Lanes acc[U][MR];
    for (int u = 0; u < U; ++u)
      for (int m = 0; m < MR; ++m) acc[u][m] = zero();
    __builtin_prefetch(next_so + 2 * g * kLanes);
    __builtin_prefetch(next_so + (2 * g + 1) * kLanes);
    for (int64_t p = g * s.per; p < (g + 1) * s.per; p += U) {
      __builtin_prefetch(next_q + p * kLanes);  // 64 bytes: 4 pairs, U of them an iteration
      for (int u = 0; u < U; ++u) {
        Lanes lo, hi;
        nibbles(q + (p + u) * kLanes, lo, hi);
        const float* xp = x + 2 * (p + u);
        for (int m = 0; m < MR; ++m) acc[u][m] = fma(xp[m * s.K + 1], hi, fma(xp[m * s.K], lo, acc[u][m]));
      }
    }
    const Lanes scale = lanes(so + 2 * g * kLanes), offset = lanes(so + (2 * g + 1) * kLanes);
    for (int m = 0; m < MR; ++m) {
      Lanes sum = acc[0][m];
      for (int u = 1; u < U; ++u) sum = add(sum, acc[u][m]);
      total[m] = fma(xsum[m * s.G + g], offset, fma(sum, scale, total[m]));
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = total[m];
}

// x's sums over each group, in float: the offsets' term.
template <typename T>
std::vector<float> group_sums(const T* x, const Int4Shape& s) {
  std::vector<float> xsum(s.M * s.G);
  const int64_t run = s.K / s.G;
  for (int64_t m = 0; m < s.M; ++m) {
    for (int64_t g = 0; g < s.G; ++g) {
      const T* src = x + m * s.K + g * run;
      float sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int64_t k = 0; k < run; ++k) sum += ld(src[k]);
      xsum[m * s.G + g] = sum;
    }
  }
  return xsum;
}

// Calls block(mr, q, sob, next_q, next_so, m0, out) for every block of 16
// output rows and every kMaxRows rows of x (mr: their number, a constant),
// then stores out into y.
template <typename T, typename F>
void over_blocks(const uint8_t* packed, const T* so, const Int4Shape& s, T* y, F&& block) {
  // A block is K * 8 bytes of weights: at least ~64 KiB of them a thread, so
  // that a small matrix stays on the calling thread.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 13) / s.K);
  at::parallel_for(0, s.blocks, grain, [&](int64_t begin, int64_t end) {
    Lanes out[kMaxRows];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kLanes, valid = std::min(kLanes, s.N - n0);
      const uint8_t* q = packed + b * (s.K / 2) * kLanes;
      const T* sob = so + b * s.G * 2 * kLanes;
      // The next block (the last block: itself, in cache already).
      const int64_t next = b + 1 < s.blocks ? 1 : 0;
      const uint8_t* next_q = q + next * (s.K / 2) * kLanes;
      const T* next_so = sob + next * s.G * 2 * kLanes;
      for (int64_t m0 = 0; m0 < s.M; m0 += kMaxRows) {
        const int rows = int(std::min<int64_t>(kMaxRows, s.M - m0));
        with_rows<kMaxRows>(rows, [&](auto mr) { block(mr, q, sob, next_q, next_so, m0, out); });
        for (int m = 0; m < rows; ++m) store(y + (m0 + m) * s.N + n0, out[m], valid);
      }
    }
  });
}

template <typename T>
void gemv(const T* x, const uint8_t* packed, const T* so, const Int4Shape& s, T* y) {
  std::vector<float> xf(s.M * s.K);  // x in float, once for every block
  for (int64_t i = 0; i < s.M * s.K; ++i) xf[i] = ld(x[i]);
  const std::vector<float> xsum = group_sums(x, s);
  over_blocks(packed, so, s, y, [&](auto mr, auto q, auto sob, auto next_q, auto next_so, int64_t m0, Lanes* out) {
    gemv_block<T, mr.value>(q, sob, next_q, next_so, xf.data() + m0 * s.K, xsum.data() + m0 * s.G, s, out);
  });
}

#ifdef TGI_INT4_INT8X
// The same product with x quantized to int8 per 32 columns (int4_vnni.h).
template <typename T>
void gemv_int8x(const T* x, const uint8_t* packed, const T* so, const Int4Shape& s, T* y) {
  const int64_t runs = s.K / int4_vnni::kRun;
  std::vector<int8_t> xq(s.M * s.K);
  std::vector<float> dx(s.M * runs), xs(s.M * runs);
  std::vector<int32_t> qs(s.M * runs);
  int4_vnni::quantize(x, s.M, s.K, xq.data(), dx.data(), xs.data(), qs.data());
  // x summed over each group (the offsets' term) from its runs' sums.
  std::vector<float> xsum(s.M * s.G, 0.0f);
  for (int64_t i = 0; i < s.M * runs; ++i) xsum[i / (runs / s.G)] += xs[i];
  over_blocks(packed, so, s, y, [&](auto mr, auto q, auto sob, auto next_q, auto next_so, int64_t m0, Lanes* out) {
    int4_vnni::block<T, mr.value>(q, sob, next_q, next_so, xq.data() + m0 * s.K, dx.data() + m0 * runs,
                                  xsum.data() + m0 * s.G, s.K, s.G, s.per, out);
  });
}
#endif

#if defined(TGI_BF16_GEMM) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TGI_INT4_BF16 1
// One block (16 rows) of the int4 layout dequantized into the bf16 GEMM's
// layout (bf16_tile.h): w = q * scale + offset in float, rounded to bf16
// once, each column pair's two values side by side in a row's 32-bit lane.
void dequantize_lanes(const uint8_t* q, const c10::BFloat16* so, const Int4Shape& s, c10::BFloat16* out) {
  alignas(64) static const uint16_t pairs[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i order = _mm512_load_si512(pairs);  // word 2 j <- lo j, word 2 j + 1 <- hi j
  for (int64_t g = 0; g < s.G; ++g) {
    const Lanes scale = lanes(so + 2 * g * kLanes), offset = lanes(so + (2 * g + 1) * kLanes);
    for (int64_t p = g * s.per; p < (g + 1) * s.per; ++p) {
      Lanes lo, hi;
      nibbles(q + p * kLanes, lo, hi);
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(fma(hi, scale, offset).v, fma(lo, scale, offset).v);
      _mm512_storeu_si512(out + p * 2 * kLanes, _mm512_permutexvar_epi16(order, both));
    }
  }
}

// bf16 x [M, K] @ w.T: each pair of blocks dequantized once into a
// per-thread scratch (2 x K x 16 bf16, in L1/L2), then the bf16 GEMM's tiles
// run every row of x over it.
void bf16_mm_dequantized(const c10::BFloat16* x, const uint8_t* packed, const c10::BFloat16* so, const Int4Shape& s,
                         c10::BFloat16* y) {
  using bf16_tile::kRows;
  parallel_steal((s.blocks + 1) / 2, [&](int64_t pair) {
    thread_local std::vector<c10::BFloat16> scratch;
    scratch.resize(2 * s.K * kLanes);
    const int64_t b = 2 * pair, nb = std::min<int64_t>(2, s.blocks - b);
    for (int64_t i = 0; i < nb; ++i)
      dequantize_lanes(packed + (b + i) * (s.K / 2) * kLanes, so + (b + i) * s.G * 2 * kLanes, s,
                       scratch.data() + i * s.K * kLanes);
    for (int64_t m0 = 0; m0 < s.M; m0 += kRows) {
      with_rows<kRows>(int(std::min(kRows, s.M - m0)), [&](auto mr) {
        if (nb == 2)
          bf16_tile::tile<mr.value, 2>(x + m0 * s.K, scratch.data(), nullptr, s.K, s.N, b * kLanes, y + m0 * s.N);
        else
          bf16_tile::tile<mr.value, 1>(x + m0 * s.K, scratch.data(), nullptr, s.K, s.N, b * kLanes, y + m0 * s.N);
      });
    }
  });
}
#endif

// w^T [K, ceil(N / 16) * 16] in T: block b fills columns [16 b, 16 b + 16).
// Four column pairs (one 64-byte line of each block) at a time across all
// blocks, so that each row of w^T is written front to back (block-major
// wrote a far-apart 32-64 bytes per row and fetched each line twice, several
// times slower: docs/tuning.md#int4-gemm-kernels).
template <typename T>
void dequantize_t(const uint8_t* packed, const T* so, const Int4Shape& s, T* wt) {
  constexpr int64_t kPairsALine = 64 / kLanes;
  const int64_t ld = s.blocks * kLanes, block_bytes = (s.K / 2) * kLanes;
  at::parallel_for(0, s.K / 2 / kPairsALine, 8, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t p0 = c * kPairsALine, g = p0 / s.per;
      for (int64_t b = 0; b < s.blocks; ++b) {
        const T* sob = so + (b * s.G + g) * 2 * kLanes;
        const Lanes scale = lanes(sob), offset = lanes(sob + kLanes);
        const uint8_t* q = packed + b * block_bytes + p0 * kLanes;
        for (int64_t p = 0; p < kPairsALine; ++p) {
          Lanes lo, hi;
          nibbles(q + p * kLanes, lo, hi);
          store(wt + 2 * (p0 + p) * ld + b * kLanes, fma(lo, scale, offset), kLanes);
          store(wt + (2 * (p0 + p) + 1) * ld + b * kLanes, fma(hi, scale, offset), kLanes);
        }
      }
    }
  });
}

#ifdef TGI_INT4_AMX
// The kernel asks Linux once for the AMX tile state (ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA); without it a tile instruction faults.
bool amx_ready() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Word order that interleaves [lo_0..lo_15, hi_0..hi_15] into pairs (lo_j, hi_j).
alignas(64) constexpr int16_t kPairs[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                            8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

inline __m512 bf16_lanes(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// One B tile: 16 column pairs x 16 output rows of w in bf16. Row r holds, for
// each output row j, (w[j, 2 p], w[j, 2 p + 1]) with p the r-th pair: the
// layout TDPBF16PS multiplies. q: the 16 pairs' bytes [16, 16]; so: their
// group's scales and offsets [2, 16]; next_q, next_so: the tile's to prefetch.
inline void dequant_tile(const uint8_t* q, const c10::BFloat16* so, const uint8_t* next_q,
                         const c10::BFloat16* next_so, __m512i* tile) {
  const __m512 scale = bf16_lanes(so), offset = bf16_lanes(so + kLanes);
  const __m512i pairs = _mm512_load_si512(kPairs), nibble = _mm512_set1_epi32(15);
  __builtin_prefetch(next_so);
  for (int r = 0; r < 16; ++r) {
    if (r % 4 == 0) __builtin_prefetch(next_q + r * kLanes);
    const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + r * kLanes)));
    const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(w, nibble)), scale, offset);
    const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4)), scale, offset);
    tile[r] = _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// x [Mp, K] bf16 (rows a multiple of 16; rows past M zero) -> y [M, N].
// Tiles: 0-3 accumulate y for (16 rows of x) x (16 output rows), 4-5 hold x,
// 6-7 the weights. Each thread takes output rows 32 at a time; their weights
// are dequantized once, on the first 32 rows of x, into a per-thread strip
// reused for the next ones.
void amx_mm(const c10::BFloat16* x, int64_t Mp, const uint8_t* packed, const c10::BFloat16* so, const Int4Shape& s,
            c10::BFloat16* y) {
  const int64_t steps = s.K / 32, pairs_of_blocks = (s.blocks + 1) / 2, xstride = s.K * 2;
  at::parallel_for(0, pairs_of_blocks, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<__m512i> strip;  // [steps, 2, 16] tile rows
    strip.resize(steps * 2 * 16);
    alignas(64) float out[4][16][16];
    TileConfig config;
    for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
    for (int64_t c = begin; c < end; ++c) {
      const int64_t b0 = 2 * c;
      const bool two_n = b0 + 1 < s.blocks;
      // Step ks's weight tiles (32 columns of one or two blocks) into the strip.
      auto dequant_step = [&](int64_t ks) {
        const int64_t g = ks * 16 / s.per;
        for (int64_t h = 0; h < (two_n ? 2 : 1); ++h) {
          const int64_t b = b0 + h, next = b + 2 < s.blocks ? b + 2 : b;  // the next pair's same tile
          dequant_tile(packed + (b * (s.K / 2) + ks * 16) * kLanes, so + (b * s.G + g) * 2 * kLanes,
                       packed + (next * (s.K / 2) + ks * 16) * kLanes, so + (next * s.G + g) * 2 * kLanes,
                       strip.data() + ks * 32 + 16 * h);
        }
      };
      for (int64_t mc = 0; mc < Mp; mc += 32) {
        const bool two_m = mc + 16 < Mp;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t ks = 0; ks < steps; ++ks) {
          const __m512i* t0 = strip.data() + ks * 32;
          if (mc == 0) dequant_step(ks);
          _tile_loadd(6, t0, 64);
          _tile_loadd(4, x + mc * s.K + ks * 32, xstride);
          _tile_dpbf16ps(0, 4, 6);
          if (two_n) {
            _tile_loadd(7, t0 + 16, 64);
            _tile_dpbf16ps(1, 4, 7);
          }
          if (two_m) {
            _tile_loadd(5, x + (mc + 16) * s.K + ks * 32, xstride);
            _tile_dpbf16ps(2, 5, 6);
            if (two_n) _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, out[0], 64);
        if (two_n) _tile_stored(1, out[1], 64);
        if (two_m) _tile_stored(2, out[2], 64);
        if (two_m && two_n) _tile_stored(3, out[3], 64);
        for (int64_t i = 0; i < (two_m ? 2 : 1); ++i) {
          for (int64_t h = 0; h < (two_n ? 2 : 1); ++h) {
            const int64_t n0 = (b0 + h) * kLanes;
            const __mmask16 valid = __mmask16((1u << std::min(kLanes, s.N - n0)) - 1);
            for (int64_t r = 0; r < 16 && mc + 16 * i + r < s.M; ++r) {
              const __m256bh v = _mm512_cvtneps_pbh(_mm512_load_ps(out[2 * i + h][r]));
              _mm256_mask_storeu_epi16(y + (mc + 16 * i + r) * s.N + n0, valid, (__m256i)v);
            }
          }
        }
      }
    }
    _tile_release();
  });
}
#endif

}  // namespace

// x [M, K] -> x @ w.T [M, N] in x's dtype, on the float-lane GEMV: the kernel
// for a few rows (decode), float32 exact to rounding.
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_offset, int64_t n) {
  const Int4Shape s = check(x, packed, scale_offset, n);
  auto y = at::empty({s.M, s.N}, x.options());
  TGI_DISPATCH_16_32(x.scalar_type(), "int4_gemv", [&] {
    gemv(x.const_data_ptr<scalar_t>(), packed.const_data_ptr<uint8_t>(), scale_offset.const_data_ptr<scalar_t>(), s,
         y.mutable_data_ptr<scalar_t>());
  });
  return y;
}

// bf16 x [M, K] -> x @ w.T [M, N]: pairs of weight blocks dequantized to
// bf16 (as the dense model holds them) into the bf16 GEMM's tiles; the
// kernel for many rows on AVX512-BF16 CPUs (bf16_mm_available).
at::Tensor int4_bf16_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_offset, int64_t n) {
  const Int4Shape s = check(x, packed, scale_offset, n);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "int4_bf16_mm takes bf16");
  auto y = at::empty({s.M, s.N}, x.options());
#ifdef TGI_INT4_BF16
  bf16_mm_dequantized(x.const_data_ptr<c10::BFloat16>(), packed.const_data_ptr<uint8_t>(),
                      scale_offset.const_data_ptr<c10::BFloat16>(), s, y.mutable_data_ptr<c10::BFloat16>());
#else
  TORCH_CHECK(false, "int4_bf16_mm: no AVX512-BF16 here (see bf16_mm_available)");
#endif
  return y;
}

// True where int4_gemv_int8x can run: built with AVX2 (vpmaddubsw) or with
// AVX512-VNNI and -VBMI (vpdpbusd).
bool int4_int8x_available() {
#ifdef TGI_INT4_INT8X
  return true;
#else
  return false;
#endif
}

// x [M, K] -> x @ w.T [M, N] in x's dtype, x quantized to int8 per row and 32
// columns on the way (int4_vnni.h): the GEMV for a few rows where activations
// need not stay exact (QuantLinear's choice; int4_gemv keeps float32 exact).
at::Tensor int4_gemv_int8x(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_offset, int64_t n) {
  const Int4Shape s = check(x, packed, scale_offset, n);
  TORCH_CHECK(int4_int8x_available(), "int4_gemv_int8x: no AVX2 or AVX512-VNNI here (see int4_int8x_available)");
  auto y = at::empty({s.M, s.N}, x.options());
#ifdef TGI_INT4_INT8X
  TGI_DISPATCH_16_32(x.scalar_type(), "int4_gemv_int8x", [&] {
    gemv_int8x(x.const_data_ptr<scalar_t>(), packed.const_data_ptr<uint8_t>(), scale_offset.const_data_ptr<scalar_t>(),
               s, y.mutable_data_ptr<scalar_t>());
  });
#endif
  return y;
}

// The same product through one dense GEMM: w dequantized into a per-thread
// scratch [K, N] (one matrix at a time; never kept), then at::mm.
at::Tensor int4_dequant_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_offset, int64_t n) {
  const Int4Shape s = check(x, packed, scale_offset, n);
  thread_local at::Tensor scratch;
  const int64_t numel = s.K * s.blocks * kLanes;
  if (!scratch.defined() || scratch.scalar_type() != x.scalar_type() || scratch.numel() < numel)
    scratch = at::empty({numel}, x.options());
  auto wt = scratch.narrow(0, 0, numel).view({s.K, s.blocks * kLanes});
  TGI_DISPATCH_16_32(x.scalar_type(), "int4_dequant_mm", [&] {
    dequantize_t(packed.const_data_ptr<uint8_t>(), scale_offset.const_data_ptr<scalar_t>(), s,
                 wt.mutable_data_ptr<scalar_t>());
  });
  return at::mm(x, wt.narrow(1, 0, s.N));
}

// True where int4_amx_mm can run: built with AMX-BF16 and granted the tile state.
bool int4_amx_available() {
#ifdef TGI_INT4_AMX
  return amx_ready();
#else
  return false;
#endif
}

// bf16 x [M, K] -> x @ w.T [M, N] on AMX tiles (weights rounded to bf16,
// float accumulation): the kernel for many rows.
at::Tensor int4_amx_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_offset, int64_t n) {
  const Int4Shape s = check(x, packed, scale_offset, n);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "int4_amx_mm takes bf16");
  TORCH_CHECK(int4_amx_available(), "int4_amx_mm: no AMX here (see int4_amx_available)");
  auto y = at::empty({s.M, s.N}, x.options());
#ifdef TGI_INT4_AMX
  const int64_t Mp = (s.M + 15) / 16 * 16;
  // Tiles read 16 rows of x at a time: a partial last block reads zero rows.
  const at::Tensor xp = Mp == s.M ? x : at::constant_pad_nd(x, {0, 0, 0, Mp - s.M});
  amx_mm(xp.const_data_ptr<c10::BFloat16>(), Mp, packed.const_data_ptr<uint8_t>(),
         scale_offset.const_data_ptr<c10::BFloat16>(), s, y.mutable_data_ptr<c10::BFloat16>());
#endif
  return y;
}

}  // namespace tgi

TORCH_LIBRARY_FRAGMENT(tgi, m) {
  m.def("int4_gemv(Tensor x, Tensor packed, Tensor scale_offset, int n) -> Tensor");
  m.def("int4_dequant_mm(Tensor x, Tensor packed, Tensor scale_offset, int n) -> Tensor");
  m.def("int4_amx_mm(Tensor x, Tensor packed, Tensor scale_offset, int n) -> Tensor");
  m.def("int4_amx_available() -> bool", tgi::int4_amx_available);
  m.def("int4_gemv_int8x(Tensor x, Tensor packed, Tensor scale_offset, int n) -> Tensor");
  m.def("int4_int8x_available() -> bool", tgi::int4_int8x_available);
  m.def("int4_bf16_mm(Tensor x, Tensor packed, Tensor scale_offset, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(tgi, CPU, m) {
  m.impl("int4_gemv", tgi::int4_gemv);
  m.impl("int4_dequant_mm", tgi::int4_dequant_mm);
  m.impl("int4_amx_mm", tgi::int4_amx_mm);
  m.impl("int4_gemv_int8x", tgi::int4_gemv_int8x);
  m.impl("int4_bf16_mm", tgi::int4_bf16_mm);
}
