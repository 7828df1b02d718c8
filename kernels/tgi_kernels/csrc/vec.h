// The widest float vector this build's -march=native offers, for kernels
// whose inner loops GCC's auto-vectorizer handles poorly (dot products that
// end in a horizontal sum). TGI_VEC is 1 where one exists (AVX-512F, or
// AVX2 with FMA); kernels keep a plain C++ path for other CPUs.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>
#define TGI_VEC 1
namespace tgi::vec {
constexpr int kWidth = 16;
using R = __m512;
inline R load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, R v) { _mm512_storeu_ps(p, v); }
inline R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
inline R mul(R a, R b) { return _mm512_mul_ps(a, b); }
inline R set1(float x) { return _mm512_set1_ps(x); }
inline float sum(R v) { return _mm512_reduce_add_ps(v); }

// The lane sums of 16 vectors as one vector: out[t] = sum of a[t]'s 16
// lanes, in a fixed order (pairs of lanes, then pairs of pairs, then across
// the four 128-bit quarters). 45 shuffles and adds where 16 reduce_add_ps
// take ~130, and no long dependency chain.
inline R sum16(const R* a) {
  R b[8], c[4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // per quarter: [a0+a2, b0+b2, a1+a3, b1+b3] of a[2i], a[2i+1]
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {  // per quarter: the quarter's sums of a[4j..4j+3]
    const __m512d p = _mm512_castps_pd(b[2 * j]), q = _mm512_castps_pd(b[2 * j + 1]);
    c[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p, q)), _mm512_castpd_ps(_mm512_unpackhi_pd(p, q)));
  }
  // Quarters: e01 = [c0.0+c0.1, c0.2+c0.3, c1.0+c1.1, c1.2+c1.3], e23 likewise;
  // then quarter j of the result = all four quarters of c[j].
  const R e01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const R e23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, 0x88), _mm512_shuffle_f32x4(e01, e23, 0xDD));
}
}  // namespace tgi::vec
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TGI_VEC 1
namespace tgi::vec {
constexpr int kWidth = 8;
using R = __m256;
inline R load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, R v) { _mm256_storeu_ps(p, v); }
inline R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
inline R mul(R a, R b) { return _mm256_mul_ps(a, b); }
inline R set1(float x) { return _mm256_set1_ps(x); }
inline float sum(R v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
}  // namespace tgi::vec
#else
#define TGI_VEC 0
#endif
