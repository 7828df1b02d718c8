// The sampler's full-vocabulary passes (server/tgi_server/sampling/vocab_blocks.py):
// per row and per block of logits, sum(exp(x / t - top)); and a greedy
// row's whole choice, its argmax and log-normalizer, from the logits as the
// model gave them. For the sums, torch's version (index_select, div, sub,
// Sleef exp, sum over blocks: five passes over a [4, W] chunk at a time)
// is slow at a vocabulary's width; here it is one pass, exp by common.h's
// polynomial (figures: docs/tuning.md#sampler-vocabulary-passes).
#include "common.h"

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

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

constexpr int64_t kLanes = 16, kFind = 64, kSpan = 1024;

// Row x [V] (T: float or bf16, widened exactly): *token = the first index of
// its maximum, *lse = max + log(sum(exp(x - max))). buf: V floats of scratch
// (a bf16 row is widened into it once, while its maximum is taken). Three
// vectorized passes: the maximum in 16 lanes; the first block of 64 that
// holds it; the sum, in 16 float lanes over spans of 1,024 logits, the spans
// added in double in order (one row's order whatever the batch). Per-64
// reductions as exp_block_sums makes cost more; this replaces the Sampler's
// float32 copy, block maxima and exp_block_sums for a greedy row (figures:
// docs/tuning.md#sampler-vocabulary-passes).
template <typename T>
void greedy_row(const T* x, int64_t V, float* buf, int64_t* token, float* lse) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t body = V - V % kLanes;
  float lane[kLanes];
  std::fill(lane, lane + kLanes, kNegInf);
  const float* f = buf;
  if constexpr (std::is_same_v<T, float>) {
    f = x;
    for (int64_t i = 0; i < body; i += kLanes)
#pragma omp simd
      for (int64_t j = 0; j < kLanes; ++j) lane[j] = lane[j] > f[i + j] ? lane[j] : f[i + j];
  } else {
    for (int64_t i = 0; i < body; i += kLanes)
#pragma omp simd
      for (int64_t j = 0; j < kLanes; ++j) {
        const float v = ld(x[i + j]);
        buf[i + j] = v;
        lane[j] = lane[j] > v ? lane[j] : v;
      }
    for (int64_t i = body; i < V; ++i) buf[i] = ld(x[i]);
  }
  float top = kNegInf;
  for (int64_t j = 0; j < kLanes; ++j) top = std::max(top, lane[j]);
  for (int64_t i = body; i < V; ++i) top = std::max(top, f[i]);
  int64_t index = 0;
  for (int64_t b0 = 0; b0 < V; b0 += kFind) {
    const int64_t n = std::min(kFind, V - b0);
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t i = 0; i < n; ++i) hit |= f[b0 + i] == top;
    if (hit) {
      for (index = b0; f[index] != top; ++index) {
      }
      break;
    }
  }
  double total = 0;
  for (int64_t s0 = 0; s0 < V; s0 += kSpan) {
    const int64_t n = std::min(kSpan, V - s0), full = n - n % kLanes;
    float acc[kLanes] = {};
    for (int64_t i = 0; i < full; i += kLanes)
#pragma omp simd
      for (int64_t j = 0; j < kLanes; ++j) acc[j] += exp_approx(f[s0 + i + j] - top);
    for (int64_t i = full; i < n; ++i) acc[i - full] += exp_approx(f[s0 + i] - top);
    for (int64_t j = 0; j < kLanes; ++j) total += acc[j];
  }
  *token = index;
  *lse = top + float(std::log(total));
}

}  // namespace

// x [B, V] float32 or bf16 (unit last stride), rows [R] int64 or none (all
// B) -> (tokens [R] int64: the first index of each row's maximum, lse [R]
// float32: each row's logsumexp), the greedy rows' whole choice in one pass
// over their logits, with no float32 copy of the batch. Each row's results
// depend on its logits alone, not on its dtype (bf16 widens exactly) nor on
// the batch.
std::tuple<at::Tensor, at::Tensor> greedy_rows(const at::Tensor& x, const std::optional<at::Tensor>& rows) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be float32 or bf16 [B, V] with unit last stride");
  TORCH_CHECK(!rows || (rows->scalar_type() == at::kLong && rows->dim() == 1 && rows->is_contiguous()),
              "rows must be int64 [R]");
  const int64_t n = rows ? rows->numel() : x.size(0), V = x.size(1), stride = x.stride(0);
  const int64_t* rp = rows ? rows->const_data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(!rp || (rp[i] >= 0 && rp[i] < x.size(0)), "row index out of range");
  auto tokens = at::empty({n}, x.options().dtype(at::kLong));
  auto lse = at::empty({n}, x.options().dtype(at::kFloat));
  int64_t* tp = tokens.mutable_data_ptr<int64_t>();
  float* lp = lse.mutable_data_ptr<float>();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(bf16 ? V : 0);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = rp ? rp[i] : i;
      if (bf16)
        greedy_row(x.const_data_ptr<c10::BFloat16>() + r * stride, V, buf.data(), tp + i, lp + i);
      else
        greedy_row(x.const_data_ptr<float>() + r * stride, V, buf.data(), tp + i, lp + i);
    }
  });
  return {tokens, lse};
}

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
  m.def("greedy_rows(Tensor x, Tensor? rows) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tgi, CPU, m) {
  m.impl("exp_block_sums", tgi::exp_block_sums);
  m.impl("greedy_rows", tgi::greedy_rows);
}
