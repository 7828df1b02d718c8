// Shared by our CPU kernels: element conversion and the dispatch over the
// dtypes the shard serves in. Every kernel computes in at::opmath_type
// (float for bf16/fp16/fp32, double for fp64) and rounds once on store.
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#define TGI_DISPATCH(dtype, name, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, name, __VA_ARGS__)

#include <cmath>
#include <cstdint>
#include <cstring>

namespace tgi {

template <typename T>
using acc_t = at::opmath_type<T>;

// Loads widened to acc_t with plain bit operations, which GCC vectorizes
// (c10::BFloat16's own conversion operator keeps loops scalar).
inline float ld(c10::BFloat16 v) {
  const uint32_t bits = uint32_t(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float ld(c10::Half v) { return float(v); }

// Stores rounded to nearest even, branch-free for bf16 (c10's constructor
// tests for NaN, which keeps loops scalar; here a NaN stays a NaN or, for
// payloads in the low 16 bits only, becomes an infinity: non-finite either way).
template <typename T>
inline T st(acc_t<T> v) {
  return T(v);
}
template <>
inline c10::BFloat16 st<c10::BFloat16>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return c10::BFloat16(uint16_t(bits >> 16), c10::BFloat16::from_bits());
}
inline float ld(float v) { return v; }
inline double ld(double v) { return v; }

// exp in float by Cody-Waite range reduction and Cephes' degree-5
// polynomial (about 1 ulp on the range that matters; inputs below -87 give
// ~1e-38, not 0, which every caller multiplies away): arithmetic only, so
// loops over it vectorize where std::exp stays a scalar call.
inline float exp_approx(float x) {
  x = std::min(88.0f, std::max(-87.0f, x));
  const float t = x * 1.44269504088896341f;
  const int n = int(t + (t >= 0 ? 0.5f : -0.5f));
  const float fn = float(n);
  const float r = (x - fn * 0.693359375f) + fn * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  const uint32_t scale_bits = uint32_t(n + 127) << 23;
  float scale;
  std::memcpy(&scale, &scale_bits, sizeof scale);
  return e * scale;
}
inline double exp_approx(double x) { return std::exp(x); }

// An attention score capped softly (gemma2): cap * tanh(s / cap), as transformers computes it.
template <typename A>
inline A soft_cap(A s, A cap) { return cap * std::tanh(s / cap); }

// Rows of a [rows, n] problem each thread should take at least, so that a
// small problem runs on the calling thread (a parallel region costs a few us).
inline int64_t grain_rows(int64_t n, int64_t min_elems = 1 << 15) {
  return std::max<int64_t>(1, min_elems / std::max<int64_t>(1, n));
}

}  // namespace tgi
