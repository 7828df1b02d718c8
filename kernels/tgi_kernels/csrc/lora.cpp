// Multi-LoRA deltas (server/tgi_server/layers/lora.py): every adapter's
// low-rank update on its own rows of the step, in one call per layer. Torch's
// path, a GEMM pair per adapter's run of rows, spends its time at decode's
// sizes on library set-up, not arithmetic: more than the step itself with
// adapters on every linear (figures: docs/tuning.md#lora-kernel).
#include "lanes.h"

#include <algorithm>
#include <array>
#include <vector>

namespace tgi {
namespace {

namespace L = lanes16;
constexpr int64_t kMaxRank = 1024;
constexpr int kRows = L::kMaxRows;  // rows of one adapter a work item takes: their accumulators stay in registers

// y rows [N, out] += (x rows [N, in] A^T) B^T for N rows of one adapter:
// A [rank, in], bt = B^T [rank, out], x and y rows xs and ys apart. Each row
// of A and of B^T is read once for the N rows (once per row, the adapter's
// matrices came from L2 32 times a decode step). t = x A^T stays in float (no
// rounding between the two products); y is widened 16 outputs at a time,
// accumulated in float registers over the whole rank and rounded once.
template <typename T, int N>
void lora_rows(const T* x, int64_t xs, int64_t in, const T* a, const T* bt, int64_t rank, int64_t out, T* y,
               int64_t ys) {
  float t[N][kMaxRank];
  const int64_t in_body = in - in % L::kLanes, out_body = out - out % L::kLanes;
  for (int64_t j = 0; j < rank; ++j) {
    const T* aj = a + j * in;
    L::Lanes s[N];
    for (int r = 0; r < N; ++r) s[r] = L::zero();
    for (int64_t k = 0; k < in_body; k += L::kLanes) {
      const L::Lanes w = L::lanes(aj + k);
      for (int r = 0; r < N; ++r) s[r] = L::fma(L::lanes(x + r * xs + k), w, s[r]);
    }
    for (int r = 0; r < N; ++r) {
      float lanes[L::kLanes], sum = 0;
      L::store(lanes, s[r], L::kLanes);
      for (int64_t i = 0; i < L::kLanes; ++i) sum += lanes[i];
      for (int64_t k = in_body; k < in; ++k) sum += ld(x[r * xs + k]) * ld(aj[k]);
      t[r][j] = sum;
    }
  }
  for (int64_t o = 0; o < out_body; o += L::kLanes) {
    L::Lanes acc[N];
    for (int r = 0; r < N; ++r) acc[r] = L::lanes(y + r * ys + o);
    for (int64_t j = 0; j < rank; ++j) {
      const L::Lanes b = L::lanes(bt + j * out + o);
      for (int r = 0; r < N; ++r) acc[r] = L::fma(t[r][j], b, acc[r]);
    }
    for (int r = 0; r < N; ++r) L::store(y + r * ys + o, acc[r], L::kLanes);
  }
  for (int r = 0; r < N; ++r)
    for (int64_t o = out_body; o < out; ++o) {
      float acc = ld(y[r * ys + o]);
      for (int64_t j = 0; j < rank; ++j) acc += t[r][j] * ld(bt[j * out + o]);
      y[r * ys + o] = st<T>(acc);
    }
}

}  // namespace

// y [T, out] += on each segment's rows (x A_i^T) B_i^T, in place.
// x [T, in]; a [R, in] and bt [R, out] (B^T) hold every adapter's rows in
// adapter order, adapter i (1-based) rows offsets[i - 1] .. offsets[i]
// (offsets int64 [N + 1], offsets[0] = 0; an adapter that does not target
// this layer has none); segments int64 [S, 3]: (adapter i >= 1, first row,
// end row). float32, bf16 or float16. Each row's result depends on that row alone.
void lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
               const at::Tensor& offsets, const at::Tensor& segments) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.stride(1) == 1 && y.stride(1) == 1 && x.size(0) == y.size(0),
              "x [T, in] and y [T, out] need unit last strides and the same rows");
  TORCH_CHECK(a.is_contiguous() && bt.is_contiguous() && a.dim() == 2 && bt.dim() == 2 && a.size(0) == bt.size(0) &&
                  a.size(1) == x.size(1) && bt.size(1) == y.size(1),
              "a must be contiguous [R, in] and bt [R, out]");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == x.scalar_type() &&
                  bt.scalar_type() == x.scalar_type(), "x, y, a and bt must share a dtype");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1 && offsets.is_contiguous() &&
                  segments.scalar_type() == at::kLong && segments.is_contiguous() &&
                  (segments.numel() == 0 || (segments.dim() == 2 && segments.size(1) == 3)),
              "offsets must be int64 [N + 1] and segments int64 [S, 3]");
  const int64_t* off = offsets.const_data_ptr<int64_t>();
  const int64_t adapters = offsets.numel() - 1, rows = x.size(0), R = a.size(0);
  TORCH_CHECK(adapters >= 0 && off[0] == 0 && off[adapters] == R, "offsets must run from 0 to a's rows");
  // Blocks of up to kRows rows of one adapter, each a work item.
  std::vector<std::array<int64_t, 3>> work;  // (first row, rows, adapter)
  const int64_t* seg = segments.const_data_ptr<int64_t>();
  for (int64_t s = 0; s < segments.numel() / 3; ++s) {
    const int64_t i = seg[3 * s], first = seg[3 * s + 1], end = seg[3 * s + 2];
    TORCH_CHECK(i >= 1 && i <= adapters && 0 <= first && first <= end && end <= rows,
                "segment (", i, ", ", first, ", ", end, ") is outside the adapters or the rows");
    TORCH_CHECK(0 <= off[i - 1] && off[i - 1] <= off[i] && off[i] <= R && off[i] - off[i - 1] <= kMaxRank,
                "adapter ", i, "'s rows must lie within a's, at most ", kMaxRank);
    if (off[i] > off[i - 1])
      for (int64_t r = first; r < end; r += kRows) work.push_back({r, std::min<int64_t>(kRows, end - r), i});
  }
  const int64_t in = x.size(1), out = y.size(1), xs = x.stride(0), ys = y.stride(0);
  TGI_DISPATCH_16_32(x.scalar_type(), "lora_add_", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* ap = a.const_data_ptr<scalar_t>();
    const scalar_t* bp = bt.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    const int64_t per_block = kRows * (R / std::max<int64_t>(1, adapters) + 1) * (in + out);
    at::parallel_for(0, int64_t(work.size()), grain_rows(per_block), [&](int64_t begin, int64_t end) {
      for (int64_t w = begin; w < end; ++w) {
        const auto [r, n, i] = work[w];
        L::with_rows<kRows>(int(n), [&](auto rows) {
          lora_rows<scalar_t, rows.value>(xp + r * xs, xs, in, ap + off[i - 1] * in, bp + off[i - 1] * out,
                                          off[i] - off[i - 1], out, yp + r * ys, ys);
        });
      }
    });
  });
}

}  // namespace tgi

TORCH_LIBRARY_FRAGMENT(tgi, m) {
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor a, Tensor bt, Tensor offsets, Tensor segments) -> ()");
}

TORCH_LIBRARY_IMPL(tgi, CPU, m) {
  m.impl("lora_add_", tgi::lora_add_);
}
