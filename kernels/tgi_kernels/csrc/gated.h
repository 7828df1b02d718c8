// Gated MLP activations, act(gate) * up, on one row: what activation.cpp's
// silu_mul / gelu_tanh_mul run over a gate_up GEMM's output and what
// bf16_gemm.cpp's bf16_mm_gated runs on each tile's sums (the same code, so
// the fused and unfused paths give the same bits).
#pragma once

#include "common.h"

#include <string>

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

// out[i] = Act(gate[i]) * up[i], computed in acc_t<T>, for i < n.
template <typename Act, typename T>
void row(const T* gate, const T* up, T* out, int64_t n) {
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
