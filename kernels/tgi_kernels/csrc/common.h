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

namespace tgi {

template <typename T>
using acc_t = at::opmath_type<T>;

// Rows of a [rows, n] problem each thread should take at least, so that a
// small problem runs on the calling thread (a parallel region costs a few us).
inline int64_t grain_rows(int64_t n, int64_t min_elems = 1 << 15) {
  return std::max<int64_t>(1, min_elems / std::max<int64_t>(1, n));
}

}  // namespace tgi
