// Gated MLP activations on the fused gate_up GEMM's output, in one pass (the
// eager split + activation + mul is three kernels and two temporaries):
// SwiGLU's silu(gate) * up and GeGLU's gelu_tanh(gate) * up (gemma).
#include "common.h"
#include "gated.h"

namespace tgi {
namespace {

// gate_up [T, 2 I] (gate columns first, then up) -> act(gate) * up, [T, I].
template <typename Act>
at::Tensor gated_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [T, 2 I] with unit last stride");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = at::empty({rows, n}, gate_up.options());
  TGI_DISPATCH(gate_up.scalar_type(), "gated_mul", [&] {
    const scalar_t* x = gate_up.const_data_ptr<scalar_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(n, 1 << 14), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) gated::row<Act>(x + r * stride, x + r * stride + n, o + r * n, n);
    });
  });
  return out;
}

}  // namespace

at::Tensor silu_mul(const at::Tensor& gate_up) { return gated_mul<gated::Silu>(gate_up); }
at::Tensor gelu_tanh_mul(const at::Tensor& gate_up) { return gated_mul<gated::GeluTanh>(gate_up); }

}  // namespace tgi

TORCH_LIBRARY_FRAGMENT(tgi, m) {
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_tanh_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(tgi, CPU, m) {
  m.impl("silu_mul", tgi::silu_mul);
  m.impl("gelu_tanh_mul", tgi::gelu_tanh_mul);
}
