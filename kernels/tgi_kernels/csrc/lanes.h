// Sixteen float lanes, one per output row of a block of 16 weight rows: the
// register type of our quantized GEMV kernels (int4_gemm.cpp, int8_gemv.cpp),
// whose layouts put 16 output rows side by side so that a weight column is
// one vector and nothing is transposed or summed horizontally. One zmm under
// AVX-512, two ymm under AVX2, a plain array (auto-vectorized) elsewhere.
#pragma once

#include "common.h"

#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// The activations' dtypes these kernels take (not float64).
#define TGI_DISPATCH_16_32(dtype, name, ...)                  \
  AT_DISPATCH_SWITCH(dtype, name,                             \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace tgi::lanes16 {

constexpr int64_t kLanes = 16;  // output rows a block of the layout holds

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr int kMaxRows = 8;  // rows of x a GEMV pass keeps in registers (32 zmm)
struct Lanes {
  __m512 v;
};
inline Lanes zero() { return {_mm512_setzero_ps()}; }
inline Lanes add(Lanes a, Lanes b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Lanes fma(Lanes a, Lanes b, Lanes c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Lanes fma(float a, Lanes b, Lanes c) { return {_mm512_fmadd_ps(_mm512_set1_ps(a), b.v, c.v)}; }
// 16 bytes -> their low nibbles and their high nibbles as float lanes. A
// 16-entry lookup (vpermps reads the index's low 4 bits) stands for the mask
// and int -> float conversion: two port-5 uops instead of three on port 0.
inline void nibbles(const uint8_t* p, Lanes& lo, Lanes& hi) {
  const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  lo = {_mm512_permutexvar_ps(w, values)};
  hi = {_mm512_permutexvar_ps(_mm512_srli_epi32(w, 4), values)};
}
// 16 signed bytes as float lanes.
inline Lanes int8s(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)))};
}
inline Lanes lanes(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Lanes lanes(const c10::BFloat16* p) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16))};
}
inline Lanes lanes(const c10::Half* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p))}; }
// The first n (<= 16) lanes stored in a dtype, rounded to nearest even.
inline __mmask16 first(int64_t n) { return __mmask16((1u << n) - 1); }
inline void store(float* p, Lanes a, int64_t n) { _mm512_mask_storeu_ps(p, first(n), a.v); }
inline void store(c10::BFloat16* p, Lanes a, int64_t n) {
#ifdef __AVX512BF16__
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(a.v);
#else
  const __m512i u = _mm512_castps_si512(a.v);  // finite values: no NaN case
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                                         _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
  const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
  _mm256_mask_storeu_epi16(p, first(n), h);
}
inline void store(c10::Half* p, Lanes a, int64_t n) {
  _mm256_mask_storeu_epi16(p, first(n), _mm512_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TGI_LANES_AVX2 1
constexpr int kMaxRows = 4;  // 16 ymm: a Lanes is two of them
struct Lanes {
  __m256 a, b;
};
inline Lanes zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Lanes add(Lanes x, Lanes y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
inline Lanes fma(Lanes x, Lanes y, Lanes z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
inline Lanes fma(float x, Lanes y, Lanes z) {
  const __m256 s = _mm256_set1_ps(x);
  return {_mm256_fmadd_ps(s, y.a, z.a), _mm256_fmadd_ps(s, y.b, z.b)};
}
inline void nibbles(const uint8_t* p, Lanes& lo, Lanes& hi) {
  const __m256i w0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  const __m256i w1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8)));
  const __m256i m = _mm256_set1_epi32(15);
  lo = {_mm256_cvtepi32_ps(_mm256_and_si256(w0, m)), _mm256_cvtepi32_ps(_mm256_and_si256(w1, m))};
  hi = {_mm256_cvtepi32_ps(_mm256_srli_epi32(w0, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(w1, 4))};
}
inline Lanes int8s(const int8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))))};
}
inline Lanes lanes(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 bf16x8(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline Lanes lanes(const c10::BFloat16* p) { return {bf16x8(p), bf16x8(p + 8)}; }
inline Lanes lanes(const c10::Half* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)))};
}
inline void store(float* p, Lanes x, int64_t n) {
  if (n == kLanes) {
    _mm256_storeu_ps(p, x.a);
    _mm256_storeu_ps(p + 8, x.b);
    return;
  }
  alignas(32) float f[kLanes];
  _mm256_store_ps(f, x.a);
  _mm256_store_ps(f + 8, x.b);
  std::memcpy(p, f, n * sizeof(float));
}
template <typename T>
inline void store(T* p, Lanes x, int64_t n) {
  alignas(32) float f[kLanes];
  _mm256_store_ps(f, x.a);
  _mm256_store_ps(f + 8, x.b);
  for (int64_t j = 0; j < n; ++j) p[j] = T(f[j]);
}
#else
constexpr int kMaxRows = 4;
struct Lanes {
  float v[kLanes];
};
inline Lanes zero() { return {}; }
inline Lanes add(Lanes a, Lanes b) {
#pragma omp simd
  for (int64_t j = 0; j < kLanes; ++j) a.v[j] += b.v[j];
  return a;
}
inline Lanes fma(Lanes a, Lanes b, Lanes c) {
#pragma omp simd
  for (int64_t j = 0; j < kLanes; ++j) c.v[j] += a.v[j] * b.v[j];
  return c;
}
inline Lanes fma(float a, Lanes b, Lanes c) {
#pragma omp simd
  for (int64_t j = 0; j < kLanes; ++j) c.v[j] += a * b.v[j];
  return c;
}
inline void nibbles(const uint8_t* p, Lanes& lo, Lanes& hi) {
#pragma omp simd
  for (int64_t j = 0; j < kLanes; ++j) {
    lo.v[j] = float(p[j] & 15);
    hi.v[j] = float(p[j] >> 4);
  }
}
template <typename T>
inline Lanes lanes(const T* p) {
  Lanes a;
#pragma omp simd
  for (int64_t j = 0; j < kLanes; ++j) a.v[j] = float(p[j]);
  return a;
}
inline Lanes int8s(const int8_t* p) { return lanes(p); }
template <typename T>
inline void store(T* p, Lanes a, int64_t n) {
  for (int64_t j = 0; j < n; ++j) p[j] = T(a.v[j]);
}
#endif

// Independent multiply-add chains a GEMV keeps in flight (an FMA waits ~4
// cycles for its accumulator; more chains measured no faster at one row).
constexpr int kChains = 4;

// Calls f(std::integral_constant<int, r>) for r = rows, 1 <= rows <= R.
template <int R, typename F>
void with_rows(int rows, F&& f) {
  if constexpr (R > 1) {
    if (rows < R) return with_rows<R - 1>(rows, f);
  }
  f(std::integral_constant<int, R>{});
}

}  // namespace tgi::lanes16
