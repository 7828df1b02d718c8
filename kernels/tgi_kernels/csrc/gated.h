// Gated MLP activations, act(gate) * up, on one row: what activation.cpp's
// silu_mul / gelu_tanh_mul run over a gate_up GEMM's output and what
// bf16_gemm.cpp's bf16_mm_gated runs on each tile's sums (the same code, so
// the fused and unfused paths give the same bits).
#pragma once

#include "common.h"
#include "vec.h"

#include <string>
#include <type_traits>

namespace tgi::gated {

struct Silu {
  template <typename A>
  static A apply(A g) { return g / (A(1) + exp_approx(-g)); }
};

// 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), torch's approximate="tanh";
// tanh(y) = 1 - 2 / (exp(2y) + 1), exact at both saturations.
struct GeluTanh {
  template <typename A>
  static A apply(A g) {
    const A y = A(0.7978845608028654) * (g + A(0.044715) * g * g * g);
    return A(0.5) * g * (A(2) - A(2) / (exp_approx(A(2) * y) + A(1)));
  }
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TGI_GATED_BF16 1  // masked 16-bit loads and stores need BW and VL
// Act(g) * u on 16 lanes rounded to bf16, Act in vec::exp's arithmetic: the
// one code both bf16 paths run (row below and the gated GEMM's tiles on
// their sums), so they agree bit for bit. GCC made of the scalar loop a call
// per row over 8-lane halves with integer rounding, which held the gated GEMM
// further behind the plain one (figures: docs/tuning.md#gated-gemm-activation).
template <typename Act>
inline __m256bh apply16(__m512 g, __m512 u) {
  const __m512 one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f);
  __m512 a;
  if constexpr (std::is_same_v<Act, Silu>) {
    a = _mm512_div_ps(g, _mm512_add_ps(one, vec::exp(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  } else {
    const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), g), g), g);
    const __m512 y = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f), _mm512_add_ps(g, g3));
    const __m512 t = _mm512_sub_ps(two, _mm512_div_ps(two, _mm512_add_ps(vec::exp(_mm512_mul_ps(two, y)), one)));
    a = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g), t);
  }
  return _mm512_cvtneps_pbh(_mm512_mul_ps(a, u));
}

// 16 bf16 lanes widened to float (exact).
inline __m512 widen(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }
#endif

// out[i] = Act(gate[i]) * up[i], computed in acc_t<T>, for i < n.
template <typename Act, typename T>
void row(const T* gate, const T* up, T* out, int64_t n) {
#ifdef TGI_GATED_BF16
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 k = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
      const __m256bh r = apply16<Act>(widen(_mm256_maskz_loadu_epi16(k, gate + i)),
                                      widen(_mm256_maskz_loadu_epi16(k, up + i)));
      _mm256_mask_storeu_epi16(out + i, k, (__m256i)r);
    }
    return;
  }
#endif
  using A = acc_t<T>;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = st<T>(Act::apply(ld(gate[i])) * ld(up[i]));
}

// Calls f(Silu{}) or f(GeluTanh{}) for act "silu" or "gelu_tanh".
template <typename F>
void with_act(const std::string& act, F&& f) {
  if (act == "silu") return f(Silu{});
  TORCH_CHECK(act == "gelu_tanh", "act must be silu or gelu_tanh, not ", act);
  f(GeluTanh{});
}

}  // namespace tgi::gated
