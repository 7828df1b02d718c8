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
