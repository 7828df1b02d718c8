// Gated MLP activations on the fused gate_up GEMM's output, in one pass (the
// eager split + activation + mul is three kernels and two temporaries):
// SwiGLU's silu(gate) * up and GeGLU's gelu_tanh(gate) * up (gemma).
#include "common.h"

#include <cmath>

namespace tgi {
namespace {

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

template <typename Act, typename T>
void gated_row(const T* gate, const T* up, T* out, int64_t n) {
  using A = acc_t<T>;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = st<T>(Act::apply(ld(gate[i])) * ld(up[i]));
}

// gate_up [T, 2 I] (gate columns first, then up) -> act(gate) * up, [T, I].
template <typename Act>
at::Tensor gated(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [T, 2 I] with unit last stride");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = at::empty({rows, n}, gate_up.options());
  TGI_DISPATCH(gate_up.scalar_type(), "gated_mul", [&] {
    const scalar_t* x = gate_up.const_data_ptr<scalar_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(n, 1 << 14), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) gated_row<Act>(x + r * stride, x + r * stride + n, o + r * n, n);
    });
  });
  return out;
}

}  // namespace

at::Tensor silu_mul(const at::Tensor& gate_up) { return gated<Silu>(gate_up); }
at::Tensor gelu_tanh_mul(const at::Tensor& gate_up) { return gated<GeluTanh>(gate_up); }

}  // namespace tgi

TORCH_LIBRARY_FRAGMENT(tgi, m) {
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_tanh_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(tgi, CPU, m) {
  m.impl("silu_mul", tgi::silu_mul);
  m.impl("gelu_tanh_mul", tgi::gelu_tanh_mul);
}
