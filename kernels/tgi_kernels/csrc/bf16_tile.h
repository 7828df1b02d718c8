// The bf16 GEMM's tile (bf16_gemm.cpp), shared with int4_gemm.cpp's
// int4_bf16_mm, which dequantizes a pair of weight blocks into this layout
// and runs the same tiles over every row of x.
//   w  [B, K / 2, 16, 2] bf16: (b, p, j) holds w[16 b + j, 2 p] and w[16 b + j, 2 p + 1].
#pragma once

#include "common.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define TGI_BF16_GEMM 1
#endif

namespace tgi::bf16_tile {

#ifdef TGI_BF16_GEMM
constexpr int64_t kLanes = 16, kRows = 8;  // output rows a block holds; rows of x a tile takes

// acc += w . (the bf16 pair at x, broadcast), one vdpbf16ps with an embedded
// broadcast (GCC emits a separate broadcast for _mm512_set1_epi32).
inline __m512 dp(__m512 acc, __m512i w, const c10::BFloat16* x) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
}

// 64-byte lines to prefetch into L2 while a tile runs, one per k-pair
// step: a slice of the blocks the thread takes next.
struct Ahead {
  const char* lines = nullptr;
  int64_t count = 0;
};

// Ahead for row tile t of `tiles` over some blocks: the t-th slice of the
// nb blocks at `next`, those the thread takes after them, so that all the
// row tiles together load them; none for a single tile (it streams its own
// weights, prefetching within them).
inline Ahead ahead_slice(const c10::BFloat16* next, int64_t nb, int64_t K, int64_t t, int64_t tiles) {
  if (tiles < 2 || nb == 0) return {};
  const int64_t lines = nb * K * kLanes * 2 / 64, begin = lines * t / tiles, end = lines * (t + 1) / tiles;
  return {reinterpret_cast<const char*>(next) + begin * 64, end - begin};
}

// MR rows of x (row stride K) against NB consecutive blocks from w (each
// K * 16 elements) -> sums [MR, NB * 16] in float.
template <int MR, int NB>
void tile_sums(const c10::BFloat16* x, const c10::BFloat16* w, int64_t K, float* sums, Ahead ahead = {}) {
  // Unrolled in full (GCC unrolls these loops only partly by itself): the
  // accumulators then live in registers, not on the stack (much slower:
  // docs/tuning.md#bf16-gemm).
  __m512 acc[MR][NB];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 2
    for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
  const int64_t block = K * kLanes;
  for (int64_t p = 0; p < K / 2; ++p) {
    __m512i wv[NB];
#pragma GCC unroll 2
    for (int b = 0; b < NB; ++b) {
      wv[b] = _mm512_loadu_si512(w + b * block + p * 2 * kLanes);
      // 32 lines (2 KB) ahead, into L2: into L1 (prefetcht0) they filled the
      // core's few L1 miss buffers (figures: docs/tuning.md#weight-prefetch-distance).
      if (!ahead.lines) __builtin_prefetch(w + b * block + (p + 32) * 2 * kLanes, 0, 2);
    }
    if (p < ahead.count) __builtin_prefetch(ahead.lines + p * 64, 0, 2);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 2
      for (int b = 0; b < NB; ++b) acc[m][b] = dp(acc[m][b], wv[b], x + m * K + 2 * p);
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 2
    for (int b = 0; b < NB; ++b) _mm512_store_ps(sums + (m * NB + b) * kLanes, acc[m][b]);
}

// tile_sums, then y [MR rows of stride N] gets them at columns n0.. (the
// valid columns of the last block only), bias added before rounding.
template <int MR, int NB>
void tile(const c10::BFloat16* x, const c10::BFloat16* w, const float* bias, int64_t K, int64_t N, int64_t n0,
          c10::BFloat16* y, Ahead ahead = {}) {
  alignas(64) float sums[MR * NB * kLanes];
  tile_sums<MR, NB>(x, w, K, sums, ahead);
  for (int b = 0; b < NB; ++b) {
    const int64_t col = n0 + b * kLanes, valid = std::min(kLanes, N - col);
    const __mmask16 mask = __mmask16((1u << valid) - 1);
    const __m512 add = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) {
      const __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(sums + (m * NB + b) * kLanes), add));
      _mm256_mask_storeu_epi16(y + m * N + col, mask, (__m256i)v);
    }
  }
}

#endif

}  // namespace tgi::bf16_tile
