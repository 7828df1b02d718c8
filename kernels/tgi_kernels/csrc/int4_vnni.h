// The int4 GEMV with x quantized to int8 (int4_gemm.cpp's int4_gemv_int8x),
// for bf16 / fp16 activations on CPUs with AVX512-VNNI and AVX512-VBMI: the
// products of 4-bit weights and 8-bit activations summed exactly in int32 by
// vpdpbusd, 64 per instruction, where the float GEMV does 16 multiply-adds an
// instruction after widening every nibble to a float. It reads int4_gemm.cpp's
// layout as it is (no second copy of the weights): one 64-byte line holds 4
// column pairs of 16 rows, byte 16 i + j = row j's columns 2 i (low nibble)
// and 2 i + 1 (high); one byte permutation per nibble half puts each row's 4
// columns into its own 32-bit lane.
//
// x is quantized per row and 32 columns (dx = max |x| / 127, x ~ dx * xq):
// llama.cpp's Q8 activations. Each output is then
//   sum over groups g of scale[g] * sum over 32-column runs r of g of dx[r] * isum[r]
//                        + offset[g] * sum(x over g)
// with isum exact and sum(x) taken from x itself, so the offsets are exact.
#pragma once

#include "common.h"
#include "lanes.h"

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define TGI_INT4_VNNI 1

namespace tgi::int4_vnni {

using lanes16::kLanes;

constexpr int64_t kRun = 32;  // columns that share one activation scale

// Column c of every 8 goes to byte (c & 1) * 4 + c / 2 of its 8: the order
// (0, 2, 4, 6, 1, 3, 5, 7) in which the permuted nibbles hold them.
inline int64_t slot(int64_t c) { return (c & ~int64_t(7)) + (c & 1) * 4 + ((c & 7) >> 1); }

// x [M, K] -> xq [M, K] int8 (each 8 columns in slot order), dx [M, K / 32].
template <typename T>
void quantize(const T* x, int64_t M, int64_t K, int8_t* xq, float* dx) {
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t r = 0; r < K / kRun; ++r) {
      const T* src = x + m * K + r * kRun;
      float v[kRun], amax = 0;
      for (int64_t c = 0; c < kRun; ++c) {
        v[c] = ld(src[c]);
        amax = std::max(amax, std::abs(v[c]));
      }
      const float inv = amax > 0 ? 127.0f / amax : 0.0f;
      int8_t* dst = xq + m * K + r * kRun;
      for (int64_t c = 0; c < kRun; ++c) dst[slot(c)] = int8_t(std::nearbyint(v[c] * inv));
      dx[m * (K / kRun) + r] = amax / 127.0f;
    }
  }
}

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

}  // namespace tgi::int4_vnni
#endif
