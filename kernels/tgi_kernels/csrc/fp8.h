// fp8 KV cache elements (--kv-cache-dtype fp8_e4m3fn | fp8_e5m2): widened
// to float where the attention kernels read a row, rounded to nearest even
// with saturation where the KV store writes one. The kernels take the
// cache's element type C beside the query's T: C is T itself or an fp8 type.
#pragma once

#include "common.h"
#include "lanes.h"

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
// (16 bytes a load, denormals exact): each byte unpacked into the high byte
// of a 16-bit lane is e5m2's float16; for e4m3fn an arithmetic shift right
// by one moves its exponent and mantissa into float16's fields (bias 7
// against 15: the float16 of v / 256) and the cleared bit 14 drops the
// sign's copy. A stored NaN (never written: stores saturate) would read as
// 480. Half the instructions of masking and shifting each field: the decode
// kernel widens every row it reads.
template <typename C>
inline void widen(const C* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  if constexpr (kIsFp8<C>) {
    const auto* bytes = reinterpret_cast<const uint8_t*>(src);
    const __m128i zero = _mm_setzero_si128();
    auto store8 = [&](float* out, __m128i high) {  // 8 lanes of (byte << 8)
      if constexpr (std::is_same_v<C, c10::Float8_e5m2>) {
        _mm256_storeu_ps(out, _mm256_cvtph_ps(high));
      } else {
        const __m128i h = _mm_and_si128(_mm_srai_epi16(high, 1), _mm_set1_epi16(int16_t(0xBFFF)));
        _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f)));
      }
    };
    for (; i + 16 <= n; i += 16) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + i));
      store8(dst + i, _mm_unpacklo_epi8(zero, b));
      store8(dst + i + 8, _mm_unpackhi_epi8(zero, b));
    }
  }
#endif
#pragma omp simd
  for (int64_t j = i; j < n; ++j) dst[j] = ld(src[j]);
}

#if defined(__AVX512F__)
// 16 floats (finite, within the format's range) as fp8 bytes, rounded to
// nearest even as c10's conversion rounds them: a normal value keeps its
// float exponent, rebiased, and the top 3 (e4m3fn) or 2 (e5m2) mantissa bits,
// rounded by adding half an ulp less one plus the kept lsb (a carry moves
// into the exponent); one below the smallest normal (2^-6, 2^-14) is its
// multiple of the smallest subnormal (2^-9, 2^-16), rounded by vcvtps2dq.
template <typename C>
inline __m128i fp8_bytes(__m512 x) {
  constexpr bool e4m3 = std::is_same_v<C, c10::Float8_e4m3fn>;
  constexpr int drop = e4m3 ? 20 : 21;                     // float mantissa bits dropped
  constexpr int rebias = e4m3 ? (127 - 7) << 3 : (127 - 15) << 2;
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(magnitude, drop), _mm512_set1_epi32(1));
  const __m512i half = _mm512_add_epi32(_mm512_set1_epi32((1 << (drop - 1)) - 1), lsb);
  const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_add_epi32(magnitude, half), drop),
                                          _mm512_set1_epi32(rebias));
  const float subnormal_unit = e4m3 ? 512.0f : 65536.0f;   // 1 / the smallest subnormal
  const __m512i tiny = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(magnitude), _mm512_set1_ps(subnormal_unit)));
  const __mmask16 below = _mm512_cmplt_epi32_mask(magnitude, _mm512_set1_epi32(e4m3 ? 0x3C800000 : 0x38800000));
  const __m512i code = _mm512_or_si512(_mm512_mask_blend_epi32(below, normal, tiny),
                                       _mm512_srli_epi32(_mm512_andnot_si512(magnitude, bits), 24));
  return _mm512_cvtepi32_epi8(code);
}
#endif

// n elements of src (in T) into dst (in C): fp8 of src * inv_scale,
// saturated to the format's largest finite value (a plain cast overflows
// to NaN or infinity); a plain copy where C is T (inv_scale is then 1).
// With AVX-512, 16 at a time (fp8_bytes), sources read as lanes16's float
// lanes: the KV store writes every step's keys and values through here.
template <typename C, typename T>
inline void narrow(const T* src, C* dst, int64_t n, float inv_scale) {
  if constexpr (kIsFp8<C>) {
    const float top = float(std::numeric_limits<C>::max());  // 448 (e4m3fn), 57344 (e5m2)
    int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)  // lanes16::Lanes is one zmm
    if constexpr (!std::is_same_v<T, double>) {
      const __m512 scale = _mm512_set1_ps(inv_scale), high = _mm512_set1_ps(top), low = _mm512_set1_ps(-top);
      for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(lanes16::lanes(src + i).v, scale), low), high);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), fp8_bytes<C>(x));
      }
    }
#endif
    for (; i < n; ++i) dst[i] = C(std::clamp(float(ld(src[i])) * inv_scale, -top, top));
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
