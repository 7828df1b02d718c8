// RMSNorm, alone and fused with the residual add that precedes it in a
// pre-norm decoder layer. One pass over each row in opmath, one rounding:
// the eager path's composite op launches five kernels, which costs far more
// than the arithmetic at decode's rows (figures: docs/tuning.md#rmsnorm-kernel).
#include "common.h"

namespace tgi {
namespace {

template <typename T>
void norm_row(const T* x, const T* w, T* out, int64_t n, double eps) {
  using A = acc_t<T>;
  A sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += ld(x[i]) * ld(x[i]);
  A inv = A(1) / std::sqrt(sum / A(n) + A(eps));
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = st<T>(ld(x[i]) * inv * ld(w[i]));
}

template <typename T>
void add_norm_row(const T* x, T* residual, const T* w, T* out, int64_t n, double eps) {
  using A = acc_t<T>;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) residual[i] = st<T>(ld(residual[i]) + ld(x[i]));
  norm_row(residual, w, out, n, eps);
}

void check(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, "x must be a CPU [T, N] tensor with unit last stride");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be [N] in x's dtype");
}

}  // namespace

// x [T, N] -> weight * x / rms(x), [T, N] in x's dtype.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight);
  auto out = at::empty(x.sizes(), x.options());
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  TGI_DISPATCH(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* wp = weight.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) norm_row(xp + r * stride, wp, op + r * n, n, eps);
    });
  });
  return out;
}

// residual += x (rounded to the dtype, as `residual + x` would be), then
// returns rms_norm(residual). x, residual [T, N]; residual contiguous.
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check(x, weight);
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "residual must be contiguous, with x's shape and dtype");
  auto out = at::empty(x.sizes(), x.options());
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  TGI_DISPATCH(x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* wp = weight.const_data_ptr<scalar_t>();
    scalar_t* rp = residual.mutable_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) add_norm_row(xp + r * stride, rp + r * n, wp, op + r * n, n, eps);
    });
  });
  return out;
}

}  // namespace tgi

TORCH_LIBRARY_FRAGMENT(tgi, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(tgi, CPU, m) {
  m.impl("rms_norm", tgi::rms_norm);
  m.impl("add_rms_norm", tgi::add_rms_norm);
}
