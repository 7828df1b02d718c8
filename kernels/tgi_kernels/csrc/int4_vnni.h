// The int4 GEMV with x quantized to int8 (int4_gemm.cpp's int4_gemv_int8x):
// the products of 4-bit weights and 8-bit activations summed exactly in
// integers, where the float GEMV does 16 multiply-adds an instruction after
// widening every nibble to a float. It reads int4_gemm.cpp's layout as it is
// (no second copy of the weights): one 64-byte line holds 4 column pairs of
// 16 rows, byte 16 i + j = row j's columns 2 i (low nibble) and 2 i + 1 (high).
// - AVX512-VNNI and -VBMI (Zen 4, Ice Lake and later): one byte permutation
//   per nibble half puts each row's 4 columns into its own 32-bit lane, and
//   vpdpbusd sums 64 products an instruction into int32.
// - AVX2 (Zen 1-3, Haswell and later): the nibble halves of two pairs,
//   interleaved byte by byte (vpunpck*bw, within 128-bit lanes), give each
//   row's two columns side by side, and vpmaddubsw sums 32 products an
//   instruction into int16: at most 2 * 15 * 127 per product pair and 8 of
//   them per run of 32 columns, 30480 < 2^15, so nothing saturates. The
//   float GEMV spends many of its uops widening nibbles to float there
//   (figures: docs/tuning.md#int4-int8-activation-gemv).
//
// x is quantized per row and 32 columns (dx = max |x| / 127, x ~ dx * xq):
// llama.cpp's Q8 activations. Each output is then
//   sum over groups g of scale[g] * sum over 32-column runs r of g of dx[r] * isum[r]
//                        + offset[g] * sum(x over g)
// with isum exact and sum(x) taken from x itself, so the offsets are exact.
#pragma once

#include "common.h"
#include "lanes.h"

#include <cstring>

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define TGI_INT4_VNNI 1
#define TGI_INT4_INT8X 1
#elif defined(TGI_LANES_AVX2)
#define TGI_INT4_INT8X 1
#endif

#ifdef TGI_INT4_INT8X
namespace tgi::int4_vnni {

using lanes16::kLanes;

constexpr int64_t kRun = 32;  // columns that share one activation scale

#ifdef TGI_INT4_VNNI
// Column c of every 8 goes to byte (c & 1) * 4 + c / 2 of its 8: the order
// (0, 2, 4, 6, 1, 3, 5, 7) in which the permuted nibbles hold them.
inline int64_t slot(int64_t c) { return (c & ~int64_t(7)) + (c & 1) * 4 + ((c & 7) >> 1); }
#else
inline int64_t slot(int64_t c) { return c; }  // the AVX2 block reads x in column order
#endif

// One run of 32 columns of x -> its 32 int8 values (in slot order) at dst;
// returns {dx, sum of x, sum of the int8 values}.
struct RunStats {
  float dx, sum;
  int32_t qsum;
};

#ifdef TGI_INT4_VNNI
template <typename T>
inline RunStats quantize_run(const T* src, int8_t* dst) {
  const __m512 v0 = lanes16::lanes(src).v, v1 = lanes16::lanes(src + 16).v;
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const __m512 inv = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
  // Rounded to nearest even (the default rounding mode), as std::nearbyint.
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
  const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);  // slot s <- column
  _mm_storeu_si128((__m128i*)dst, _mm_shuffle_epi8(_mm512_cvtepi32_epi8(q0), order));
  _mm_storeu_si128((__m128i*)(dst + 16), _mm_shuffle_epi8(_mm512_cvtepi32_epi8(q1), order));
  return {amax / 127.0f, _mm512_reduce_add_ps(_mm512_add_ps(v0, v1)),
          _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1))};
}
#else
template <typename T>
inline RunStats quantize_run(const T* src, int8_t* dst) {
  float v[kRun], amax = 0, sum = 0;
  int32_t qsum = 0;
  for (int64_t c = 0; c < kRun; ++c) {
    v[c] = ld(src[c]);
    amax = std::max(amax, std::abs(v[c]));
    sum += v[c];
  }
  const float inv = amax > 0 ? 127.0f / amax : 0.0f;
  for (int64_t c = 0; c < kRun; ++c) {
    const int8_t q = int8_t(std::nearbyint(v[c] * inv));
    dst[slot(c)] = q;
    qsum += q;
  }
  return {amax / 127.0f, sum, qsum};
}
#endif

// x [M, K] -> xq [M, K] int8 (each 8 columns in slot order), and per row
// and run of 32 columns ([M, K / 32] each): dx, the sum of x (xs) and the
// sum of xq (qs). Past 2,048 runs the threads share the rows; fewer stay on
// the calling thread. (Done one value at a time, serially, quantizing took a
// large share of a GEMV call: docs/tuning.md#int4-int8-activation-gemv.)
template <typename T>
void quantize(const T* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* xs, int32_t* qs) {
  // Runs are contiguous in x: run i of the whole [M, K] is row i / (K / 32)'s.
  at::parallel_for(0, M * (K / kRun), 2048, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const RunStats r = quantize_run(x + i * kRun, xq + i * kRun);
      dx[i] = r.dx, xs[i] = r.sum, qs[i] = r.qsum;
    }
  });
}

#ifdef TGI_INT4_VNNI
// acc += w (u8) . the four int8 at p, broadcast to every 32-bit lane, as one
// vpdpbusd with an embedded broadcast: GCC emits a separate vpbroadcastd for
// _mm512_set1_epi32, a second uop per product on the vector pipes.
inline __m512i dpbusd_broadcast(__m512i acc, __m512i w, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// MR rows against one block of 16 output rows (as int4_gemm.cpp's
// gemv_block): q its [K / 2, 16] bytes, so its [G, 2, 16] scales and
// offsets, per the number of column pairs a group. A int32 chains a row keep
// vpdpbusd's latency covered for one or two rows.
template <typename T, int MR>
void block(const uint8_t* q, const T* so, const uint8_t* next_q, const T* next_so, const int8_t* xq,
           const float* dx, const float* xsum, int64_t K, int64_t G, int64_t per, lanes16::Lanes* out) {
  constexpr int A = MR == 1 ? 4 : MR == 2 ? 2 : 1;
  alignas(64) static const uint8_t order[64] = {
      0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51, 4, 20, 36, 52, 5, 21, 37, 53,
      6, 22, 38, 54, 7, 23, 39, 55, 8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59,
      12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63};  // byte 4 j + i <- 16 i + j
  const __m512i idx = _mm512_load_si512(order), nibble = _mm512_set1_epi8(0x0F);
  // The loops over accumulators are unrolled in full so that they stay in
  // registers (GCC otherwise kept them on the stack).
  __m512 total[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) total[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __builtin_prefetch(next_so + 2 * g * kLanes);
    __builtin_prefetch(next_so + (2 * g + 1) * kLanes);
    const __m512 scale = lanes16::lanes(so + 2 * g * kLanes).v, offset = lanes16::lanes(so + (2 * g + 1) * kLanes).v;
    for (int64_t p0 = g * per; p0 < (g + 1) * per; p0 += kRun / 2) {  // 16 pairs: one run of 32 columns
      __m512i acc[A][MR];
#pragma GCC unroll 4
      for (int a = 0; a < A; ++a)
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) acc[a][m] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {  // 4 lines of 4 pairs
        const int64_t p = p0 + 4 * u;
        __builtin_prefetch(next_q + p * kLanes);
        const __m512i w = _mm512_loadu_si512(q + p * kLanes);
        const __m512i lo = _mm512_permutexvar_epi8(idx, _mm512_and_si512(w, nibble));
        const __m512i hi = _mm512_permutexvar_epi8(idx, _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble));
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          const int8_t* xp = xq + m * K + 2 * p;  // 8 columns in slot order: 4 for lo, 4 for hi
          acc[(2 * u) % A][m] = dpbusd_broadcast(acc[(2 * u) % A][m], lo, xp);
          acc[(2 * u + 1) % A][m] = dpbusd_broadcast(acc[(2 * u + 1) % A][m], hi, xp + 4);
        }
      }
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        __m512i sum = acc[0][m];
#pragma GCC unroll 4
        for (int a = 1; a < A; ++a) sum = _mm512_add_epi32(sum, acc[a][m]);
        const __m512 ds = _mm512_mul_ps(scale, _mm512_set1_ps(dx[m * (K / kRun) + 2 * p0 / kRun]));
        total[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), ds, total[m]);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) total[m] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[m * G + g]), offset, total[m]);
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) out[m] = {total[m]};
}

#else
// x's int8 columns 2 i .. 2 i + 3 at p as 32 bytes: (x[2 i], x[2 i + 1]) in
// every 16-bit lane of the low 128 bits, (x[2 i + 2], x[2 i + 3]) in the high.
inline __m256i x_pairs(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, sizeof four);
  const __m256i pick = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                        2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
  return _mm256_shuffle_epi8(_mm256_set1_epi32(four), pick);
}

// The int16 sums of 8 rows, two column pairs' worth (one per 128-bit lane),
// added into int32 and made float.
inline __m256 row_sums(__m256i acc) {
  return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc)),
                                             _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc, 1))));
}

// MR rows against one block of 16 output rows, as the VNNI block above. Each
// 32-byte load holds pairs p and p + 1 for all 16 rows; interleaving its low
// and high nibbles gives rows 0-7 (r0) and rows 8-15 (r8), each row's two
// columns of pair p in the low 128 bits and of pair p + 1 in the high.
template <typename T, int MR>
void block(const uint8_t* q, const T* so, const uint8_t* next_q, const T* next_so, const int8_t* xq,
           const float* dx, const float* xsum, int64_t K, int64_t G, int64_t per, lanes16::Lanes* out) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  lanes16::Lanes total[MR];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) total[m] = lanes16::zero();
  for (int64_t g = 0; g < G; ++g) {
    __builtin_prefetch(next_so + 2 * g * kLanes);
    __builtin_prefetch(next_so + (2 * g + 1) * kLanes);
    const lanes16::Lanes scale = lanes16::lanes(so + 2 * g * kLanes), offset = lanes16::lanes(so + (2 * g + 1) * kLanes);
    for (int64_t p0 = g * per; p0 < (g + 1) * per; p0 += kRun / 2) {  // 16 pairs: one run of 32 columns
      __m256i acc0[MR], acc8[MR];  // int16, rows 0-7 and 8-15
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) acc0[m] = acc8[m] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) {
        const int64_t p = p0 + 2 * u;
        if (u % 2 == 0) __builtin_prefetch(next_q + p * kLanes);  // one 64-byte line: 4 pairs
        const __m256i w = _mm256_loadu_si256((const __m256i*)(q + p * kLanes));
        const __m256i lo = _mm256_and_si256(w, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
        const __m256i r0 = _mm256_unpacklo_epi8(lo, hi), r8 = _mm256_unpackhi_epi8(lo, hi);
#pragma GCC unroll 4
        for (int m = 0; m < MR; ++m) {
          const __m256i xv = x_pairs(xq + m * K + 2 * p);
          acc0[m] = _mm256_add_epi16(acc0[m], _mm256_maddubs_epi16(r0, xv));
          acc8[m] = _mm256_add_epi16(acc8[m], _mm256_maddubs_epi16(r8, xv));
        }
      }
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        const __m256 ds = _mm256_set1_ps(dx[m * (K / kRun) + 2 * p0 / kRun]);
        total[m].a = _mm256_fmadd_ps(row_sums(acc0[m]), _mm256_mul_ps(scale.a, ds), total[m].a);
        total[m].b = _mm256_fmadd_ps(row_sums(acc8[m]), _mm256_mul_ps(scale.b, ds), total[m].b);
      }
    }
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) total[m] = lanes16::fma(xsum[m * G + g], offset, total[m]);
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) out[m] = total[m];
}
#endif

}  // namespace tgi::int4_vnni
#endif
