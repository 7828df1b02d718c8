// Paged decode attention for a bf16 query over a bf16 cache on CPUs with
// AVX512-BF16 (AMD Zen 4, Intel Sapphire Rapids on): the cache's rows are
// read as they are, never widened to float. Included by attention.cpp, whose
// paged_decode picks it (decode_heads_vec stays the path for every other
// dtype, cache and CPU, and for softcapped scores).
//
// Per chunk of up to 16 tokens of one block, per query head:
// - scores: each key row's dot with the query by vdpbf16ps (pairs of bf16
//   products summed in float; kD / 32 instructions a key), 16 partial-sum
//   vectors transpose-reduced to one vector of 16 scores (vec::sum16), then
//   scaled: no key is widened;
// - online softmax on that vector, in registers; the denominator kept as a
//   vector of lane sums, summed once at the end;
// - values: the chunk's exp'd scores rounded to bf16 (as SDPA's CPU flash
//   kernel rounds its probabilities before its P.V GEMM), paired by token,
//   and each pair of value rows interleaved by vpunpck[lh]wd into the token
//   pairs vdpbf16ps takes (once per group of query heads of a kv head whose
//   accumulators fit in 16 registers, pv_group): one instruction adds two
//   tokens' share to 16 output dims.
// The interleave leaves each accumulator's lanes in a fixed order (dims
// 8L + i and 8L + 4 + i of each 128-bit quarter L, see out_dim), undone once
// when the output is written.
//
// An fp8 cache (with AVX512-VBMI as well) takes the same path: each chunk's
// rows are first turned into bf16, exactly (every e4m3fn and e5m2 value is
// a bf16 value), by two 128-entry byte lookups (fp8_to_bf16), into buffers
// the passes read as they read a bf16 cache's rows.
//
// Figures: docs/tuning.md#cpu-paged-decode-attention.
#pragma once

#include "bf16_tile.h"
#include "decode_rows.h"
#include "fp8.h"
#include "vec.h"

#include <limits>
#include <type_traits>

namespace tgi {

#ifdef TGI_BF16_GEMM
namespace decode_bf16 {

constexpr int64_t kChunk = 16, kMaxHeads = 16;  // query heads a work item holds
constexpr int64_t kMaxConverted = 512;            // bf16 elements of one token's hp heads, from an fp8 cache

#if defined(__AVX512VBMI__)
#define TGI_FP8_BF16 1

// The bf16 of each fp8 magnitude (the low 7 bits), high bytes and low
// bytes: 128 entries each, two registers, for vpermt2b.
struct Fp8Table {
  __m512i hi0, hi1, lo0, lo1;
};

template <typename C>
const Fp8Table& fp8_table() {
  static const Fp8Table table = [] {
    alignas(64) uint8_t hi[128], lo[128];
    for (int m = 0; m < 128; ++m) {  // c10's own conversion: e4m3fn's 0x7F (NaN, never stored) stays NaN
      const uint16_t bits = c10::BFloat16(float(C(uint8_t(m), C::from_bits()))).x;
      hi[m] = uint8_t(bits >> 8);
      lo[m] = uint8_t(bits);
    }
    return Fp8Table{_mm512_load_si512(hi), _mm512_load_si512(hi + 64), _mm512_load_si512(lo),
                    _mm512_load_si512(lo + 64)};
  }();
  return table;
}

// n (a multiple of 64) fp8 values of src as bf16 in dst, exactly: each
// byte's magnitude looks up its bf16's two bytes (vpermt2b ignores the sign
// bit), the sign is or'ed into the high byte, the bytes interleave into
// words (per 128-bit lane: elements 0-7 from unpacklo, 8-15 from unpackhi),
// and the lanes go back in order. ~9 instructions for 64 values.
template <typename C>
inline void fp8_to_bf16(const C* src, c10::BFloat16* dst, int64_t n) {
  const Fp8Table& t = fp8_table<C>();
  const __m512i sign = _mm512_set1_epi8(char(0x80));
  const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  for (int64_t i = 0; i < n; i += 64) {
    const __m512i b = _mm512_loadu_si512(src + i);
    const __m512i hi = _mm512_or_si512(_mm512_permutex2var_epi8(t.hi0, b, t.hi1), _mm512_and_si512(b, sign));
    const __m512i lo = _mm512_permutex2var_epi8(t.lo0, b, t.lo1);
    const __m512i w0 = _mm512_unpacklo_epi8(lo, hi), w1 = _mm512_unpackhi_epi8(lo, hi);
    _mm512_storeu_si512(dst + i, _mm512_permutex2var_epi64(w0, first, w1));
    _mm512_storeu_si512(dst + i + 32, _mm512_permutex2var_epi64(w0, second, w1));
  }
}
#endif

// The caches the bf16 kernels read (heads here, prefill.cpp's tile): bf16,
// and fp8 where TGI_FP8_BF16 turns its rows into bf16.
template <typename C>
constexpr bool kReadsCache = std::is_same_v<C, c10::BFloat16>
#ifdef TGI_FP8_BF16
                             || kIsFp8<C>
#endif
    ;

inline __m512 dp(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

// The output dim held by lane `lane` (0..15) of accumulator `a` (0..kD/16-1):
// accumulators come in pairs (lo, hi) per 32 dims, from unpacklo/unpackhi.
constexpr int64_t out_dim(int64_t a, int64_t lane) {
  return 32 * (a / 2) + 8 * (lane / 4) + 4 * (a % 2) + lane % 4;
}

// P.V of one chunk (n tokens of value rows from vb, token_stride apart) for
// the GS query heads h0.. of one kv head: their accumulators acc[h] (kD / 16
// vectors a head) rescaled by correction[h], then held in registers while
// each token pair's value rows are interleaved once (a missing second token
// of an odd chunk is a zero row: its weight is 0 too) and added with the
// heads' bf16 weight pairs (pairs[h][i] = tokens 2i, 2i + 1). With fewer
// than 12 accumulators (dependency chains: vdpbf16ps's latency x its two
// ports) even and odd pairs go to two sets, added at the end. Before, one
// pass interleaved all of a kv head's pairs into 32 vectors that spilled to
// the stack and every head reloaded them (docs/architecture.md, "The shard").
template <int64_t kD, int GS>
void pv_group(const c10::BFloat16* vb, int64_t token_stride, int64_t n, int64_t h0, const float* correction,
              const int32_t (*pairs)[kChunk / 2], float (*acc)[kD]) {
  constexpr int64_t kP = kD / 32, kA = kD / 16;
  constexpr int kSets = GS * kA < 12 ? 2 : 1;
  __m512 x[kSets][GS][kA];
#pragma GCC unroll 16
  for (int g = 0; g < GS; ++g) {
    const __m512 c = _mm512_set1_ps(correction[h0 + g]);
#pragma GCC unroll 8
    for (int64_t j = 0; j < kA; ++j) {
      x[0][g][j] = _mm512_mul_ps(_mm512_load_ps(acc[h0 + g] + 16 * j), c);
      if constexpr (kSets == 2) x[1][g][j] = _mm512_setzero_ps();
    }
  }
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t i = 0; 2 * i < n; ++i) {
    const c10::BFloat16* r0 = vb + 2 * i * token_stride;
    const bool second = 2 * i + 1 < n;
    __m512i v2[2 * kP];
#pragma GCC unroll 4
    for (int64_t p = 0; p < kP; ++p) {
      const __m512i a = _mm512_loadu_si512(r0 + 32 * p);
      const __m512i b = second ? _mm512_loadu_si512(r0 + token_stride + 32 * p) : zero;
      v2[2 * p] = _mm512_unpacklo_epi16(a, b);
      v2[2 * p + 1] = _mm512_unpackhi_epi16(a, b);
    }
    __m512 (*set)[kA] = x[kSets == 2 ? i % 2 : 0];
#pragma GCC unroll 16
    for (int g = 0; g < GS; ++g) {
      const __m512i w = _mm512_set1_epi32(pairs[h0 + g][i]);
#pragma GCC unroll 8
      for (int64_t j = 0; j < kA; ++j) set[g][j] = dp(set[g][j], v2[j], w);
    }
  }
#pragma GCC unroll 16
  for (int g = 0; g < GS; ++g)
#pragma GCC unroll 8
    for (int64_t j = 0; j < kA; ++j)
      _mm512_store_ps(acc[h0 + g] + 16 * j, kSets == 2 ? _mm512_add_ps(x[0][g][j], x[kSets - 1][g][j]) : x[0][g][j]);
}

// f(std::integral_constant<int, n>) for 1 <= n <= R.
template <int R, typename F>
void with_count(int n, F&& f) {
  if constexpr (R > 1) {
    if (n < R) return with_count<R - 1>(n, f);
  }
  f(std::integral_constant<int, R>{});
}

// q [hp * G, D] bf16 (heads contiguous); k_cache/v_cache rows of
// token_stride elements of C (bf16, or fp8 where TGI_FP8_BF16 and
// hp * kD <= kMaxConverted), this work item's first kv head at offset 0;
// out [hp * G, D]. softcap must be 0 (the caller keeps softcapped models on
// decode_heads_vec). kD: 64 or 128.
template <int64_t kD, typename C>
void heads(const c10::BFloat16* q, const C* k_cache, const C* v_cache, int64_t block_stride,
           int64_t token_stride, const int32_t* table, int64_t block_size, int64_t first, int64_t last, int64_t hp,
           int64_t G, double scale, c10::BFloat16* out, const Rows& after) {
  constexpr bool kConvert = !std::is_same_v<C, c10::BFloat16>;
  alignas(64) c10::BFloat16 kbuf[kConvert ? kChunk * kMaxConverted : 1], vbuf[kConvert ? kChunk * kMaxConverted : 1];
  constexpr int64_t kP = kD / 32, kA = kD / 16;  // bf16 vectors a head row; float accumulators a head
  constexpr int kGroup = int(16 / kA);           // query heads whose accumulators fit in 16 registers
  const int64_t QH = hp * G;
  __m512i qv[kMaxHeads][kP];
  alignas(64) float acc[kMaxHeads][kD];
  float m[kMaxHeads];
  __m512 l[kMaxHeads];  // the softmax denominators' lane sums
  for (int64_t h = 0; h < QH; ++h) {
    m[h] = -std::numeric_limits<float>::infinity();
    l[h] = _mm512_setzero_ps();
    for (int64_t p = 0; p < kP; ++p) qv[h][p] = _mm512_loadu_si512(q + h * kD + 32 * p);
    for (int64_t i = 0; i < kD; ++i) acc[h][i] = 0;
  }
  const __m512 vscale = _mm512_set1_ps(float(scale));
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t0 = first; t0 < last;) {
    const int64_t block = table[t0 / block_size], offset = t0 % block_size;
    const int64_t n = std::min({kChunk, block_size - offset, last - t0});
    const C* kc = k_cache + block * block_stride + offset * token_stride;
    const C* vc = v_cache + block * block_stride + offset * token_stride;
    // The chunk's rows as bf16: in place, or turned into kbuf/vbuf (rows of hp * kD).
    const c10::BFloat16 *kb, *vb;
    int64_t stride;
    if constexpr (kConvert) {
#ifdef TGI_FP8_BF16
      for (int64_t t = 0; t < n; ++t) {
        fp8_to_bf16(kc + t * token_stride, kbuf + t * hp * kD, hp * kD);
        fp8_to_bf16(vc + t * token_stride, vbuf + t * hp * kD, hp * kD);
      }
#endif
      kb = kbuf, vb = vbuf, stride = hp * kD;
    } else {
      kb = kc, vb = vc, stride = token_stride;
    }
    const Rows ahead = next_chunk(k_cache, v_cache, block_stride, token_stride, table, block_size, kChunk, t0 + n,
                                  last, after);
    const __mmask16 valid = __mmask16((1u << n) - 1);
    // Three passes over the query heads, each pass's heads independent of
    // one another, so that the core overlaps their dependency chains (one
    // head's scores -> max -> exp -> P.V in one pass was latency-bound:
    // docs/tuning.md#cpu-paged-decode-attention).
    // 1. Scores, scaled, lanes past the chunk's end -inf.
    alignas(64) float scores[kMaxHeads][kChunk];
    for (int64_t h = 0; h < QH; ++h) {
      prefetch_share(ahead, h, QH);
      const c10::BFloat16* kh = kb + (h / G) * kD;
      __m512 a[kChunk];
#pragma GCC unroll 16
      for (int64_t t = 0; t < kChunk; ++t) {
        a[t] = _mm512_setzero_ps();
        if (t < n) {
#pragma GCC unroll 4
          for (int64_t p = 0; p < kP; ++p) a[t] = dp(a[t], qv[h][p], _mm512_loadu_si512(kh + t * stride + 32 * p));
        }
      }
      _mm512_store_ps(scores[h], _mm512_mask_blend_ps(valid, neg_inf, _mm512_mul_ps(vec::sum16(a), vscale)));
    }
    // 2. The online softmax step: weights as bf16 pairs (token 2i, 2i + 1) and the rescale.
    alignas(64) int32_t pairs[kMaxHeads][kChunk / 2];
    float correction[kMaxHeads];
    for (int64_t h = 0; h < QH; ++h) {
      const __m512 s = _mm512_load_ps(scores[h]);
      const float mx = std::max(m[h], _mm512_reduce_max_ps(s));
      // The first chunk rescales nothing: the accumulators and l are still 0.
      correction[h] = m[h] == -std::numeric_limits<float>::infinity() ? 0.0f : exp_approx(m[h] - mx);
      const __m512 p = _mm512_maskz_mov_ps(valid, vec::exp(_mm512_sub_ps(s, _mm512_set1_ps(mx))));
      l[h] = _mm512_fmadd_ps(l[h], _mm512_set1_ps(correction[h]), p);
      m[h] = mx;
      _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[h]), (__m256i)_mm512_cvtneps_pbh(p));
    }
    // 3. Values, a group of each kv head's query heads at a time.
    for (int64_t kv = 0; kv < hp; ++kv)
      for (int64_t h0 = kv * G; h0 < (kv + 1) * G; h0 += kGroup)
        with_count<kGroup>(int(std::min<int64_t>(kGroup, (kv + 1) * G - h0)), [&](auto gs) {
          pv_group<kD, gs.value>(vb + kv * kD, stride, n, h0, correction, pairs, acc);
        });
    t0 += n;
  }
  for (int64_t h = 0; h < QH; ++h) {
    const float inv = 1.0f / _mm512_reduce_add_ps(l[h]);
    for (int64_t j = 0; j < kA; ++j)
      for (int64_t lane = 0; lane < 16; ++lane) out[h * kD + out_dim(j, lane)] = st<c10::BFloat16>(acc[h][16 * j + lane] * inv);
  }
}

}  // namespace decode_bf16
#endif

}  // namespace tgi
