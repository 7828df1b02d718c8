// The sampler's one full-vocabulary pass (server/tgi_server/sampling/vocab_blocks.py):
// per row and per block of logits, sum(exp(x / t - top)). torch's version
// (index_select, div, sub, Sleef exp, sum over blocks: five passes over a
// [4, W] chunk at a time) took ~2.7 ms for 32 rows of SmolLM2's 49,152
// logits on 2 Zen 4 cores; here it is one pass, exp by common.h's polynomial.
#include "common.h"

#include <cmath>

namespace tgi {
namespace {

// sums[b] = sum over block b of exp(x[i] / t - top), x [num_blocks * block].
void row_block_sums(const float* x, float t, float top, int64_t num_blocks, int64_t block, float* sums) {
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* xb = x + b * block;
    float total = 0;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < block; ++i) total += exp_approx(xb[i] / t - top);
    sums[b] = total;
  }
}

}  // namespace

// x [B, W] float32 (rows contiguous, W a multiple of block), top [B] float32
// (each row's maximum of x / t), temperature [B] float32 or none (all 1),
// rows [R] int64 or none (all B): -> [R, W / block] float32 of
// sum(exp(x[r] / t[r] - top[r])) over each block. Each row's sums depend on
// that row alone (batch-invariant).
at::Tensor exp_block_sums(const at::Tensor& x, const at::Tensor& top, const std::optional<at::Tensor>& temperature,
                          const std::optional<at::Tensor>& rows, int64_t block) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && block > 0 &&
              x.size(1) % block == 0, "x must be float32 [B, W] with unit last stride, W a multiple of block");
  TORCH_CHECK(top.scalar_type() == at::kFloat && top.is_contiguous() && top.numel() == x.size(0),
              "top must be float32 [B]");
  TORCH_CHECK(!temperature || (temperature->scalar_type() == at::kFloat && temperature->is_contiguous() &&
                               temperature->numel() == x.size(0)), "temperature must be float32 [B]");
  TORCH_CHECK(!rows || (rows->scalar_type() == at::kLong && rows->dim() == 1 && rows->is_contiguous()),
              "rows must be int64 [R]");
  const int64_t n = rows ? rows->numel() : x.size(0), num_blocks = x.size(1) / block, stride = x.stride(0);
  auto out = at::empty({n, num_blocks}, x.options());
  const float* xp = x.const_data_ptr<float>();
  const float* tp = top.const_data_ptr<float>();
  const float* temp = temperature ? temperature->const_data_ptr<float>() : nullptr;
  const int64_t* rp = rows ? rows->const_data_ptr<int64_t>() : nullptr;
  float* op = out.mutable_data_ptr<float>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(!rp || (rp[i] >= 0 && rp[i] < x.size(0)), "row index out of range");
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = rp ? rp[i] : i;
      row_block_sums(xp + r * stride, temp ? temp[r] : 1.0f, tp[r], num_blocks, block, op + i * num_blocks);
    }
  });
  return out;
}

}  // namespace tgi

TORCH_LIBRARY_FRAGMENT(tgi, m) {
  m.def("exp_block_sums(Tensor x, Tensor top, Tensor? temperature, Tensor? rows, int block) -> Tensor");
}

TORCH_LIBRARY_IMPL(tgi, CPU, m) {
  m.impl("exp_block_sums", tgi::exp_block_sums);
}
