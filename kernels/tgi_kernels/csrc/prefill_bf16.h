// prefill.cpp's tile for a bf16 query over bf16 keys and values (the step's
// rows and a bf16 cache) on CPUs with AVX512-BF16, head dims 64 and 128, no
// softcap: nothing is widened to float before it is multiplied.
// - Scores: Q is laid out once as pairs of dims, rows as lanes ([G][D / 2]
//   vectors of 16 rows' pairs); each key's pair of dims is an embedded
//   broadcast straight from its row, so one vdpbf16ps adds two dims of 16
//   rows' dot products with one key (the float tile widens the chunk's keys
//   and multiplies one dim at a time).
// - Probabilities rounded to bf16 (as decode_bf16.h and SDPA's CPU flash
//   kernel round them before P.V) and paired by token per row; each pair of
//   value rows interleaved once per chunk (vpunpck[lh]wd, shared by the G
//   heads and the tile's rows), so one vdpbf16ps adds two keys' share to 16
//   output dims of a row. The accumulators' lanes come out permuted
//   (decode_bf16::out_dim), undone when the output is written.
// The mask, window and online softmax are the float tile's, lane by lane.
#pragma once

#include "decode_bf16.h"
#include "lanes.h"

#include <cstring>

namespace tgi {

#ifdef TGI_BF16_GEMM
namespace prefill_bf16 {

using decode_bf16::dp;
using decode_bf16::out_dim;
constexpr int64_t kRows = 16, kKeys = 16;

// acc += (x's pair at p, broadcast) . v, as bf16_tile::dp: an embedded broadcast.
inline __m512 dp_bcast(__m512 acc, __m512i v, const c10::BFloat16* p) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(v), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// One tile, as prefill.cpp's prefill_tile (same arguments; softcap 0, and
// keys whose cache holds bf16). Scratch: G * kD / 2 * 16 query pairs, G * 16
// * kD accumulators, 2 * G * 16 maxima and sums, kD * 8 interleaved values
// and 8 * 16 weight pairs, fewer floats than the float tile's.
template <int64_t kD, typename K>
void tile(const c10::BFloat16* q, int64_t q_stride, const K& keys, int64_t pos0, int64_t rows, int64_t window,
          int64_t G, float scale, c10::BFloat16* out, int64_t out_stride, float* scratch) {
  constexpr int64_t kPairs = kD / 2, kA = kD / 16, kGroup = 16 / kA;  // rows whose accumulators fit in 16 registers
  using vec::R;
  int32_t* qt = reinterpret_cast<int32_t*>(scratch);        // [G][kPairs][kRows] query pairs, rows as lanes
  float* acc = scratch + G * kPairs * kRows;                  // [G][kRows][kD], lanes permuted (out_dim)
  float* m = acc + G * kRows * kD;                            // [G][kRows]
  float* l = m + G * kRows;                                   // [G][kRows]
  __m512i* v2 = reinterpret_cast<__m512i*>(l + G * kRows);    // [kKeys / 2][kA] interleaved value pairs
  int32_t* wp = reinterpret_cast<int32_t*>(l + G * kRows + (kKeys / 2) * kD);  // [kKeys / 2][kRows] weight pairs
  for (int64_t g = 0; g < G; ++g)
    for (int64_t p = 0; p < kPairs; ++p)
      for (int64_t r = 0; r < kRows; ++r) {
        int32_t pair = 0;
        if (r < rows) std::memcpy(&pair, q + r * q_stride + g * kD + 2 * p, sizeof(pair));
        qt[(g * kPairs + p) * kRows + r] = pair;
      }
  std::fill(acc, acc + G * kRows * kD, 0.0f);
  std::fill(m, m + G * kRows, -std::numeric_limits<float>::infinity());
  std::fill(l, l + G * kRows, 0.0f);

  const int64_t last_pos = pos0 + rows - 1;
  const int64_t first = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
  alignas(64) float lanes[kRows];
  for (int64_t r = 0; r < kRows; ++r) lanes[r] = float(pos0 + r);
  const R hi = vec::load(lanes);
  const R lo = window > 0 ? vec::add(hi, vec::set1(-float(window))) : vec::set1(-1.0f);
  // Lane r of a pair vector: row r's (even key, odd key) weights.
  alignas(64) int16_t pair_index[32];
  for (int r = 0; r < 16; ++r) pair_index[2 * r] = int16_t(r), pair_index[2 * r + 1] = int16_t(16 + r);
  const __m512i by_row = _mm512_load_si512(pair_index);
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t t0 = first, n; t0 <= last_pos; t0 += n) {
    n = keys.chunk(t0, last_pos + 1);
    const c10::BFloat16* krow[kKeys];
    for (int64_t t = 0; t < n; ++t) krow[t] = keys.rows(t0 + t).first;
    for (int64_t i = 0; 2 * i < n; ++i) {
      const c10::BFloat16* a = keys.rows(t0 + 2 * i).second;
      const c10::BFloat16* b = 2 * i + 1 < n ? keys.rows(t0 + 2 * i + 1).second : nullptr;
      for (int64_t p = 0; p < kD / 32; ++p) {
        const __m512i va = _mm512_loadu_si512(a + 32 * p), vb = b ? _mm512_loadu_si512(b + 32 * p) : zero;
        _mm512_storeu_si512(v2 + i * kA + 2 * p, _mm512_unpacklo_epi16(va, vb));
        _mm512_storeu_si512(v2 + i * kA + 2 * p + 1, _mm512_unpackhi_epi16(va, vb));
      }
    }
    const bool whole = n == kKeys && t0 + n - 1 <= pos0 && (window == 0 || t0 > last_pos - window);
    for (int64_t g = 0; g < G; ++g) {
      const int32_t* qg = qt + g * kPairs * kRows;
      R a[kKeys];
#pragma GCC unroll 16
      for (int64_t t = 0; t < kKeys; ++t) a[t] = vec::set1(0.0f);
      if (n == kKeys) {
        for (int64_t p = 0; p < kPairs; ++p) {
          const __m512i x = _mm512_loadu_si512(qg + p * kRows);
#pragma GCC unroll 16
          for (int64_t t = 0; t < kKeys; ++t) a[t] = dp_bcast(a[t], x, krow[t] + 2 * p);
        }
      } else {
        for (int64_t p = 0; p < kPairs; ++p) {
          const __m512i x = _mm512_loadu_si512(qg + p * kRows);
          for (int64_t t = 0; t < n; ++t) a[t] = dp_bcast(a[t], x, krow[t] + 2 * p);
        }
      }
#pragma GCC unroll 16
      for (int64_t t = 0; t < kKeys; ++t) a[t] = vec::mul(a[t], vec::set1(scale));
      if (!whole) {
#pragma GCC unroll 16
        for (int64_t t = 0; t < kKeys; ++t) {
          const R key = vec::set1(t < n ? float(t0 + t) : std::numeric_limits<float>::infinity());
          a[t] = vec::keep(a[t], lo, key, hi);
        }
      }
      // Online softmax, lane-wise, as prefill.cpp's float tile.
      R mx = vec::load(m + g * kRows);
#pragma GCC unroll 16
      for (int64_t t = 0; t < kKeys; ++t) mx = vec::max(mx, a[t]);
      const R base = vec::max(mx, vec::set1(-std::numeric_limits<float>::max()));
      const R correction = vec::exp(vec::sub(vec::load(m + g * kRows), base));
      vec::store(m + g * kRows, mx);
      R total = vec::mul(vec::load(l + g * kRows), correction);
#pragma GCC unroll 16
      for (int64_t t = 0; t < kKeys; ++t) {
        a[t] = vec::exp(vec::sub(a[t], base));
        total = vec::add(total, a[t]);
      }
      vec::store(l + g * kRows, total);
      for (int64_t i = 0; 2 * i < n; ++i)  // rows' weight pairs (keys 2i, 2i + 1), a missing odd key's 0
        _mm512_storeu_si512(wp + i * kRows,
                            _mm512_permutexvar_epi16(by_row, (__m512i)_mm512_cvtne2ps_pbh(a[2 * i + 1], a[2 * i])));
      alignas(64) float corr[kRows];
      vec::store(corr, correction);
      float* ag = acc + g * kRows * kD;
      for (int64_t r0 = 0; r0 < rows; r0 += kGroup)
        lanes16::with_rows<int(kGroup)>(int(std::min<int64_t>(kGroup, rows - r0)), [&](auto mr) {
          constexpr int MR = mr.value;
          R x[MR][kA];
#pragma GCC unroll 8
          for (int i = 0; i < MR; ++i) {
            const R c = vec::set1(corr[r0 + i]);
#pragma GCC unroll 8
            for (int64_t j = 0; j < kA; ++j) x[i][j] = vec::mul(vec::load(ag + (r0 + i) * kD + 16 * j), c);
          }
          for (int64_t p = 0; 2 * p < n; ++p) {
#pragma GCC unroll 8
            for (int i = 0; i < MR; ++i) {
              const __m512i w = _mm512_set1_epi32(wp[p * kRows + r0 + i]);
#pragma GCC unroll 8
              for (int64_t j = 0; j < kA; ++j) x[i][j] = dp(x[i][j], _mm512_loadu_si512(v2 + p * kA + j), w);
            }
          }
#pragma GCC unroll 8
          for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
            for (int64_t j = 0; j < kA; ++j) vec::store(ag + (r0 + i) * kD + 16 * j, x[i][j]);
        });
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = 0; r < rows; ++r) {
      const float inv = 1.0f / l[g * kRows + r];
      const float* ar = acc + (g * kRows + r) * kD;
      c10::BFloat16* o = out + r * out_stride + g * kD;
      for (int64_t j = 0; j < kA; ++j)
        for (int64_t lane = 0; lane < 16; ++lane) o[out_dim(j, lane)] = st<c10::BFloat16>(ar[16 * j + lane] * inv);
    }
}

}  // namespace prefill_bf16
#endif

}  // namespace tgi
