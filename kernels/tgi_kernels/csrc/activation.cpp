// SwiGLU's gate: silu(gate) * up from the fused gate_up GEMM's output, in one
// pass (the eager split + silu + mul is three kernels and two temporaries).
#include "common.h"

#include <cmath>

namespace tgi {
namespace {

template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  using A = acc_t<T>;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const A g = ld(gate[i]);
    out[i] = st<T>(g / (A(1) + exp_approx(-g)) * ld(up[i]));
  }
}

}  // namespace

// gate_up [T, 2 I] (gate columns first, then up) -> silu(gate) * up, [T, I].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [T, 2 I] with unit last stride");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = at::empty({rows, n}, gate_up.options());
  TGI_DISPATCH(gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* x = gate_up.const_data_ptr<scalar_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(n, 1 << 14), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) silu_mul_row(x + r * stride, x + r * stride + n, o + r * n, n);
    });
  });
  return out;
}

}  // namespace tgi

TORCH_LIBRARY_FRAGMENT(tgi, m) {
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(tgi, CPU, m) {
  m.impl("silu_mul", tgi::silu_mul);
}
