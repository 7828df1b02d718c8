// fp8 KV cache elements (--kv-cache-dtype fp8_e4m3fn | fp8_e5m2): widened
// to float where the attention kernels read a row, rounded to nearest even
// with saturation where the KV store writes one. The kernels take the
// cache's element type C beside the query's T: C is T itself or an fp8 type.
#pragma once

#include "common.h"

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <limits>
#include <type_traits>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace tgi {

template <typename C>
constexpr bool kIsFp8 = std::is_same_v<C, c10::Float8_e4m3fn> || std::is_same_v<C, c10::Float8_e5m2>;

inline float ld(c10::Float8_e4m3fn v) { return float(v); }
inline float ld(c10::Float8_e5m2 v) { return float(v); }

// n elements of src as floats in dst. fp8 goes through float16 with F16C
// (8 lanes an instruction, denormals exact): e5m2 is the high byte of a
// float16; e4m3fn's sign, exponent and mantissa moved into float16's fields
// give the float16 of v / 256 (exponent bias 7 against 15). A stored NaN
// (never written: stores saturate) would read as 480.
template <typename C>
inline void widen(const C* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  if constexpr (kIsFp8<C>) {
    const auto* bytes = reinterpret_cast<const uint8_t*>(src);
    for (; i + 8 <= n; i += 8) {
      __m128i h = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + i)));
      if constexpr (std::is_same_v<C, c10::Float8_e5m2>) {
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_slli_epi16(h, 8)));
      } else {
        const __m128i sign = _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x80)), 8);
        const __m128i rest = _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7F)), 7);
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, rest)), _mm256_set1_ps(256.0f)));
      }
    }
  }
#endif
#pragma omp simd
  for (int64_t j = i; j < n; ++j) dst[j] = ld(src[j]);
}

// n elements of src (in T) into dst (in C): fp8 of src * inv_scale,
// saturated to the format's largest finite value (a plain cast overflows
// to NaN or infinity); a plain copy where C is T (inv_scale is then 1).
template <typename C, typename T>
inline void narrow(const T* src, C* dst, int64_t n, float inv_scale) {
  if constexpr (kIsFp8<C>) {
    const float top = float(std::numeric_limits<C>::max());  // 448 (e4m3fn), 57344 (e5m2)
    for (int64_t i = 0; i < n; ++i) dst[i] = C(std::clamp(float(ld(src[i])) * inv_scale, -top, top));
  } else {
    std::copy(src, src + n, dst);
  }
}

// Calls f(C{}) with C the cache's element type: T itself, or an fp8 type
// when T is float32, bfloat16 or float16.
template <typename T, typename F>
void dispatch_cache(at::ScalarType cache, const F& f) {
  if (cache == c10::CppTypeToScalarType<T>::value) return f(T{});
  if constexpr (!std::is_same_v<T, double>) {
    if (cache == at::kFloat8_e4m3fn) return f(c10::Float8_e4m3fn{});
    if (cache == at::kFloat8_e5m2) return f(c10::Float8_e5m2{});
  }
  TORCH_CHECK(false, "the KV cache must be in the query's dtype, or fp8 (e4m3fn, e5m2) under a "
              "float32, bfloat16 or float16 query; got ", cache);
}

}  // namespace tgi
