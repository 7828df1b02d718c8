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
inline R add(R a, R b) { return _mm512_add_ps(a, b); }
inline R sub(R a, R b) { return _mm512_sub_ps(a, b); }
inline R set1(float x) { return _mm512_set1_ps(x); }
inline float sum(R v) { return _mm512_reduce_add_ps(v); }
inline R max(R a, R b) { return _mm512_max_ps(a, b); }
inline R min(R a, R b) { return _mm512_min_ps(a, b); }
// x where lo < key <= hi, lane by lane; -inf elsewhere.
inline R keep(R x, R lo, R key, R hi) {
  const __mmask16 k = _mm512_cmp_ps_mask(lo, key, _CMP_LT_OQ) & _mm512_cmp_ps_mask(key, hi, _CMP_LE_OQ);
  return _mm512_mask_blend_ps(k, _mm512_set1_ps(-__builtin_inff()), x);
}
inline R round(R x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline R pow2(R n) {  // 2^n for integral n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}

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
// kWidth vectors' lane sums as one vector (out[t] = sum of a[t]'s lanes).
inline R lane_sums(const R* a) { return sum16(a); }
inline float hmax(R v) { return _mm512_reduce_max_ps(v); }
inline float lane0(R v) { return _mm512_cvtss_f32(v); }
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
inline R add(R a, R b) { return _mm256_add_ps(a, b); }
inline R sub(R a, R b) { return _mm256_sub_ps(a, b); }
inline R set1(float x) { return _mm256_set1_ps(x); }
inline float sum(R v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline R max(R a, R b) { return _mm256_max_ps(a, b); }
inline R min(R a, R b) { return _mm256_min_ps(a, b); }
inline float hmax(R v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline float lane0(R v) { return _mm256_cvtss_f32(v); }
// The lane sums of 8 vectors as one vector: out[t] = sum of a[t]'s 8 lanes
// (pairs, then pairs of pairs within each 128-bit half, then the halves):
// 6 hadds, 2 permutes and an add where 8 separate horizontal sums take ~48
// instructions.
inline R lane_sums(const R* a) {
  const R h0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const R h4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  // h0123: [a0..a3's lanes 0-3 | a0..a3's lanes 4-7]; likewise h4567
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}
inline R keep(R x, R lo, R key, R hi) {
  const R k = _mm256_and_ps(_mm256_cmp_ps(lo, key, _CMP_LT_OQ), _mm256_cmp_ps(key, hi, _CMP_LE_OQ));
  return _mm256_blendv_ps(_mm256_set1_ps(-__builtin_inff()), x, k);
}
inline R round(R x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline R pow2(R n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
}  // namespace tgi::vec
#else
#define TGI_VEC 0
#endif

#if TGI_VEC
namespace tgi::vec {
// common.h's exp_approx on a vector (the same range reduction and
// polynomial; ties of the reduction round to even instead of away from zero).
inline R exp(R x) {
  x = min(set1(88.0f), max(set1(-87.0f), x));
  const R n = round(mul(x, set1(1.44269504088896341f)));
  const R r = fma(n, set1(2.12194440e-4f), fma(n, set1(-0.693359375f), x));
  R p = set1(1.9875691500e-4f);
  p = fma(p, r, set1(1.3981999507e-3f));
  p = fma(p, r, set1(8.3334519073e-3f));
  p = fma(p, r, set1(4.1665795894e-2f));
  p = fma(p, r, set1(1.6666665459e-1f));
  p = fma(p, r, set1(5.0000001201e-1f));
  const R e = fma(mul(p, r), r, add(r, set1(1.0f)));
  return mul(e, pow2(n));
}
}  // namespace tgi::vec
#endif
