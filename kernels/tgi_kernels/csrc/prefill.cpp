// Varlen prefill attention: every prefill chunk of a step in one call, each
// sequence reading its cached prefix from its own blocks in place and its
// chunk's keys from the step's own key/value rows. The torch path loops over
// sequences in Python and runs SDPA on each (figures:
// docs/tuning.md#cpu-prefill-attention).
//
// Work is split into tiles of kRows query rows x one kv head of one
// sequence. Within a tile the query rows are the vector lanes: Q is
// transposed once ([G][D][kRows], pre-scaled), so a chunk of kKeys keys
// gives kKeys vectors of kRows scores by broadcasting each key element
// (kKeys independent accumulators, no horizontal sums), the causal/window
// mask and the online softmax run across rows lane-wise, and P.V broadcasts
// each probability over a value row. The G query heads of the kv head share
// each key/value row, widened to float once per tile. A bf16 query over bf16
// keys takes prefill_bf16.h's tile instead where the CPU has AVX512-BF16, and so
// does one over an fp8 cache where it also has AVX512-VBMI (Fp8Keys).
#include "common.h"
#include "fp8.h"
#include "prefill_bf16.h"
#include "vec.h"

#include <algorithm>
#include <limits>
#include <vector>

#if TGI_VEC
namespace tgi {
namespace {

using namespace vec;
constexpr int64_t kRows = kWidth;  // query rows of a tile: one vector of scores per key
constexpr int64_t kKeys = kWidth;  // keys a chunk: kKeys accumulators (16 zmm / 8 ymm)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// One sequence's keys of one kv head: positions < prefix in its blocks of
// the cache (elements C: T or fp8), the others in the step's key/value rows
// (row = position - prefix).
template <typename T, typename C>
struct Keys {
  const C *k_cache, *v_cache;
  const T *key, *value;
  int64_t block_stride, token_stride, key_stride, value_stride, block_size, prefix;
  const int32_t* table;

  // The chunk of keys starting at position t0: at most kKeys, within one
  // block of the cache or within the step's rows, before `last`.
  int64_t chunk(int64_t t0, int64_t last) const {
    const int64_t end = t0 < prefix ? std::min(prefix, t0 - t0 % block_size + block_size) : last;
    return std::min({kKeys, end - t0, last - t0});
  }
  // The offset of position t (< prefix) in the caches.
  int64_t cached(int64_t t) const { return table[t / block_size] * block_stride + (t % block_size) * token_stride; }
  // The key and value rows of position t, where the cache holds T (C == T).
  std::pair<const T*, const T*> rows(int64_t t) const {
    static_assert(std::is_same_v<T, C>);
    if (t < prefix) {
      const int64_t at = cached(t);
      return {k_cache + at, v_cache + at};
    }
    return {key + (t - prefix) * key_stride, value + (t - prefix) * value_stride};
  }
  // The key and value of position t as floats: D each into kw and vw.
  void widen_row(int64_t t, int64_t D, float* kw, float* vw) const {
    if (t < prefix) {
      const int64_t at = cached(t);
      widen(k_cache + at, kw, D);
      widen(v_cache + at, vw, D);
    } else {
      widen(key + (t - prefix) * key_stride, kw, D);
      widen(value + (t - prefix) * value_stride, vw, D);
    }
  }
};

// Floats of scratch a tile needs (see prefill_tile; prefill_bf16.h's tile needs fewer).
inline int64_t scratch_floats(int64_t G, int64_t D) { return 2 * G * D * kRows + 2 * G * kRows + 2 * kKeys * D; }

// One tile: `rows` (<= kRows) query rows at positions pos0.., the G query
// heads of one kv head. q: the tile's first row at the kv head's first query
// head, rows q_stride apart; out likewise ([rows, G, D] at out_stride).
template <typename T, typename C, int64_t kD>
void prefill_tile(const T* q, int64_t q_stride, const Keys<T, C>& keys, int64_t pos0, int64_t rows, int64_t window,
                  int64_t G, int64_t head_dim, float scale, float softcap, T* out, int64_t out_stride,
                  float* scratch) {
  const int64_t D = kD ? kD : head_dim, nj = D / kWidth;
  float* qt = scratch;              // [G][D][kRows] scaled queries, rows as lanes
  float* acc = qt + G * D * kRows;  // [G][kRows][D]
  float* m = acc + G * kRows * D;   // [G][kRows] running max
  float* l = m + G * kRows;         // [G][kRows] running sum
  float* kf = l + G * kRows;        // [kKeys][D] the chunk's keys, widened
  float* vf = kf + kKeys * D;       // [kKeys][D] its values
  alignas(64) float s[kKeys * kRows];  // [kKeys][kRows] scores, then probabilities
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t d = 0; d < D; ++d)
        qt[(g * D + d) * kRows + r] = r < rows ? ld(q[r * q_stride + g * D + d]) * scale : 0.0f;
  std::fill(acc, acc + G * kRows * D, 0.0f);
  std::fill(m, m + G * kRows, kNegInf);
  std::fill(l, l + G * kRows, 0.0f);

  const int64_t last_pos = pos0 + rows - 1;
  const int64_t first = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
  // Lane r: the row at position pos = pos0 + r sees keys in (lo, hi] =
  // (pos - window, pos], or [0, pos] without a window.
  alignas(64) float lanes[kRows];
  for (int64_t r = 0; r < kRows; ++r) lanes[r] = float(pos0 + r);
  const R hi = load(lanes);
  const R lo = window > 0 ? add(hi, set1(-float(window))) : set1(-1.0f);
  for (int64_t t0 = first, n; t0 <= last_pos; t0 += n) {
    n = keys.chunk(t0, last_pos + 1);
    for (int64_t t = 0; t < kKeys; ++t) {
      float* kw = kf + t * D;
      float* vw = vf + t * D;
      if (t < n) {
        keys.widen_row(t0 + t, D, kw, vw);
      } else {
        std::fill(kw, kw + D, 0.0f);
        std::fill(vw, vw + D, 0.0f);
      }
    }
    // Every row of the tile sees every key of the chunk: no mask.
    const bool whole = n == kKeys && t0 + n - 1 <= pos0 && (window == 0 || t0 > last_pos - window);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qt + g * D * kRows;
      R a[kKeys];
#pragma GCC unroll 16
      for (int64_t t = 0; t < kKeys; ++t) a[t] = set1(0.0f);
      for (int64_t d = 0; d < D; ++d) {
        const R x = load(qg + d * kRows);
#pragma GCC unroll 16
        for (int64_t t = 0; t < kKeys; ++t) a[t] = fma(x, set1(kf[t * D + d]), a[t]);
      }
      if (softcap > 0) {  // gemma2: lane by lane (a model without the cap never pays for it)
        alignas(64) float lane[kRows];
        for (int64_t t = 0; t < kKeys; ++t) {
          store(lane, a[t]);
          for (int64_t r = 0; r < kRows; ++r) lane[r] = soft_cap(lane[r], softcap);
          a[t] = load(lane);
        }
      }
      if (!whole) {
#pragma GCC unroll 16
        for (int64_t t = 0; t < kKeys; ++t) {
          const R key = set1(t < n ? float(t0 + t) : std::numeric_limits<float>::infinity());
          a[t] = keep(a[t], lo, key, hi);
        }
      }
      // Online softmax, lane-wise (one lane a row). A row that has seen no
      // key yet keeps max -inf; the finite floor of `base` keeps its
      // exp(-inf - base) at exp_approx's ~1e-38 instead of NaN, and its
      // sums, still ~0, are wiped by the next correction.
      R mx = load(m + g * kRows);
#pragma GCC unroll 16
      for (int64_t t = 0; t < kKeys; ++t) mx = max(mx, a[t]);
      const R base = max(mx, set1(-std::numeric_limits<float>::max()));
      const R correction = exp(sub(load(m + g * kRows), base));
      store(m + g * kRows, mx);
      R total = mul(load(l + g * kRows), correction);
#pragma GCC unroll 16
      for (int64_t t = 0; t < kKeys; ++t) {
        a[t] = exp(sub(a[t], base));
        total = add(total, a[t]);
        store(s + t * kRows, a[t]);
      }
      store(l + g * kRows, total);
      alignas(64) float corr[kRows];
      store(corr, correction);
      float* ag = acc + g * kRows * D;
      for (int64_t r = 0; r < rows; ++r) {
        float* ar = ag + r * D;
        const R c = set1(corr[r]);
        if constexpr (kD != 0) {
          // The row's D / kWidth accumulators side by side: independent FMA
          // chains, each probability broadcast once.
          constexpr int64_t kJ = kD / kWidth;
          R x[kJ];
#pragma GCC unroll 16
          for (int64_t j = 0; j < kJ; ++j) x[j] = mul(load(ar + j * kWidth), c);
#pragma GCC unroll 16
          for (int64_t t = 0; t < kKeys; ++t) {
            const R p = set1(s[t * kRows + r]);
#pragma GCC unroll 16
            for (int64_t j = 0; j < kJ; ++j) x[j] = fma(p, load(vf + t * D + j * kWidth), x[j]);
          }
#pragma GCC unroll 16
          for (int64_t j = 0; j < kJ; ++j) store(ar + j * kWidth, x[j]);
        } else {
          for (int64_t j = 0; j < nj; ++j) {
            R x = mul(load(ar + j * kWidth), c);
            for (int64_t t = 0; t < kKeys; ++t) x = fma(set1(s[t * kRows + r]), load(vf + t * D + j * kWidth), x);
            store(ar + j * kWidth, x);
          }
        }
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = 0; r < rows; ++r) {
      const float inv = 1.0f / l[g * kRows + r];
      const float* ar = acc + (g * kRows + r) * D;
      T* o = out + r * out_stride + g * D;
      for (int64_t d = 0; d < D; ++d) o[d] = st<T>(ar[d] * inv);
    }
}

#ifdef TGI_BF16_GEMM
static_assert(prefill_bf16::kRows == kRows && prefill_bf16::kKeys == kKeys, "the tiles are the same size");

#ifdef TGI_FP8_BF16
// Keys over an fp8 cache as the bf16 tile reads them: chunk() turns the
// chunk's cache rows into bf16 (exactly: decode_bf16::fp8_to_bf16) in the
// buffers rows() then hands out; the step's own rows (bf16) pass as they are.
// The tile asks for each chunk once, before its rows.
template <typename C, int64_t kD>
struct Fp8Keys {
  const Keys<c10::BFloat16, C>& keys;
  mutable int64_t first = 0;  // the chunk's first position
  alignas(64) mutable c10::BFloat16 k[kKeys][kD], v[kKeys][kD];

  int64_t chunk(int64_t t0, int64_t last) const {
    const int64_t n = keys.chunk(t0, last);
    if (t0 < keys.prefix) {  // a chunk lies within one block of the cache, or within the step's rows
      const int64_t at = keys.cached(t0);
      for (int64_t t = 0; t < n; ++t) {
        decode_bf16::fp8_to_bf16(keys.k_cache + at + t * keys.token_stride, k[t], kD);
        decode_bf16::fp8_to_bf16(keys.v_cache + at + t * keys.token_stride, v[t], kD);
      }
    }
    first = t0;
    return n;
  }
  std::pair<const c10::BFloat16*, const c10::BFloat16*> rows(int64_t t) const {
    if (t < keys.prefix) return {k[t - first], v[t - first]};
    return {keys.key + (t - keys.prefix) * keys.key_stride, keys.value + (t - keys.prefix) * keys.value_stride};
  }
};
#endif

// prefill_bf16::tile in prefill_tile's signature (softcap is 0 there: checked
// by the caller); a cache of C = bf16, or fp8 (turned into bf16 a chunk at a
// time) where TGI_FP8_BF16.
template <int64_t kD, typename C>
void prefill_tile_bf16(const c10::BFloat16* q, int64_t q_stride, const Keys<c10::BFloat16, C>& keys,
                       int64_t pos0, int64_t rows, int64_t window, int64_t G, int64_t /*head_dim*/, float scale,
                       float /*softcap*/, c10::BFloat16* out, int64_t out_stride, float* scratch) {
  if constexpr (std::is_same_v<C, c10::BFloat16>) {
    prefill_bf16::tile<kD>(q, q_stride, keys, pos0, rows, window, G, scale, out, out_stride, scratch);
  } else {
#ifdef TGI_FP8_BF16
    prefill_bf16::tile<kD>(q, q_stride, Fp8Keys<C, kD>{keys}, pos0, rows, window, G, scale, out, out_stride, scratch);
#endif
  }
}
#endif

}  // namespace

// query [T, H, D], key/value [T, KVH, D] (rows may be strided, heads and
// dims contiguous): the step's prefill chunks packed, sequence b owning rows
// cu_seqlens_q[b] .. cu_seqlens_q[b + 1] at positions prefix_lens[b] + i;
// its keys < prefix_lens[b] are read from k_cache/v_cache [num_blocks,
// block_size, KVH, D] (query's dtype, or fp8 read as its float value: the
// caller folds any cache scale into `scale`, key, value and the output)
// through block_tables [B, W] int32, the others from key/value. A query at
// p sees keys j with p - window < j <= p (window > 0)
// or j <= p. -> out [T, H, D] contiguous.
at::Tensor varlen_prefill(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
                          const at::Tensor& cu_seqlens_q, const at::Tensor& prefix_lens, double scale,
                          int64_t sliding_window, double softcap) {
  for (const at::Tensor* x : {&query, &key, &value})
    TORCH_CHECK(x->dim() == 3 && x->stride(2) == 1 && x->stride(1) == x->size(2),
                "query/key/value must be [T, heads, D] with contiguous heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
              k_cache.sizes() == v_cache.sizes(), "caches must be contiguous [num_blocks, block_size, KVH, D]");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(key.scalar_type() == dtype && value.scalar_type() == dtype &&
              v_cache.scalar_type() == k_cache.scalar_type(),
              "query, key and value must share a dtype, and the two caches one");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() && block_tables.dim() == 2 &&
              cu_seqlens_q.scalar_type() == at::kInt && cu_seqlens_q.is_contiguous() &&
              prefix_lens.scalar_type() == at::kInt && prefix_lens.is_contiguous(),
              "block_tables, cu_seqlens_q and prefix_lens must be contiguous int32");
  const int64_t T = query.size(0), H = query.size(1), D = query.size(2), B = prefix_lens.numel();
  const int64_t block_size = k_cache.size(1), KVH = k_cache.size(2), G = H / KVH;
  TORCH_CHECK(k_cache.size(3) == D && key.size(2) == D && value.size(2) == D && key.size(1) == KVH &&
              value.size(1) == KVH && H % KVH == 0 && key.size(0) == T && value.size(0) == T,
              "head dims or counts do not match");
  TORCH_CHECK(D % kWidth == 0, "head_dim must be a multiple of ", kWidth);
  TORCH_CHECK(cu_seqlens_q.numel() == B + 1 && block_tables.size(0) == B, "one table and prefix per sequence");
  const int32_t* cu = cu_seqlens_q.const_data_ptr<int32_t>();
  const int32_t* prefix = prefix_lens.const_data_ptr<int32_t>();
  TORCH_CHECK(cu[0] == 0 && cu[B] == T, "cu_seqlens_q must run from 0 to T");
  const int64_t width = block_tables.size(1);
  struct Tile { int64_t seq, head, row0, cost; };  // kRows rows from row0 of a sequence's chunk
  std::vector<Tile> tiles;
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = cu[b + 1] - cu[b];
    TORCH_CHECK(n >= 0 && prefix[b] >= 0 && (prefix[b] + n + block_size - 1) / block_size <= width,
                "a sequence's blocks do not fit its block table");
    for (int64_t row0 = 0; row0 < n; row0 += kRows) {
      const int64_t last = prefix[b] + std::min(n, row0 + kRows);  // keys seen by the tile's last row
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, prefix[b] + row0 - sliding_window + 1) : 0;
      for (int64_t h = 0; h < KVH; ++h) tiles.push_back({b, h, row0, last - first});
      work += KVH * (last - first);
    }
  }
  // Longest first, dealt round-robin to the threads: near-equal shares
  // although a causal tile's cost grows with its rows' positions.
  std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) { return a.cost > b.cost; });
  auto out = at::empty({T, H, D}, query.options());
  TGI_DISPATCH(dtype, "varlen_prefill", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "varlen_prefill runs float32, bfloat16 and float16");
    } else {
      dispatch_cache<scalar_t>(k_cache.scalar_type(), [&](auto cache_tag) {
        using C = decltype(cache_tag);
        const scalar_t* qp = query.const_data_ptr<scalar_t>();
        const scalar_t* kp = key.const_data_ptr<scalar_t>();
        const scalar_t* vp = value.const_data_ptr<scalar_t>();
        const C* kc = static_cast<const C*>(k_cache.const_data_ptr());
        const C* vc = static_cast<const C*>(v_cache.const_data_ptr());
        const int32_t* tables = block_tables.const_data_ptr<int32_t>();
        scalar_t* op = out.mutable_data_ptr<scalar_t>();
        auto one = D == 64 ? prefill_tile<scalar_t, C, 64>
                 : D == 128 ? prefill_tile<scalar_t, C, 128> : prefill_tile<scalar_t, C, 0>;
#ifdef TGI_BF16_GEMM
        // bf16 query and keys over a bf16 cache, or an fp8 one whose prefix rows are turned into
        // bf16 a chunk at a time: nothing widened before it is multiplied (prefill_bf16.h).
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && decode_bf16::kReadsCache<C>) {
          if ((D == 64 || D == 128) && softcap == 0) one = D == 64 ? prefill_tile_bf16<64, C> : prefill_tile_bf16<128, C>;
        }
#endif
        // Little work in all (a few short chunks): stay on this thread rather than wake the pool.
        const int64_t threads = work * G * D < (1 << 16) ? 1 : std::min<int64_t>(at::get_num_threads(), tiles.size());
        at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
          std::vector<float> scratch(scratch_floats(G, D));
          for (int64_t worker = begin; worker < end; ++worker)
            for (size_t i = worker; i < tiles.size(); i += threads) {
              const Tile& tile = tiles[i];
              const int64_t b = tile.seq, h = tile.head, row = cu[b] + tile.row0;
              const Keys<scalar_t, C> keys{kc + h * D, vc + h * D, kp + cu[b] * key.stride(0) + h * D,
                                           vp + cu[b] * value.stride(0) + h * D, block_size * KVH * D, KVH * D,
                                           key.stride(0), value.stride(0), block_size, prefix[b], tables + b * width};
              const int64_t rows = std::min<int64_t>(kRows, cu[b + 1] - row);
              one(qp + row * query.stride(0) + h * G * D, query.stride(0), keys, prefix[b] + tile.row0, rows,
                  sliding_window, G, D, float(scale), float(softcap), op + (row * H + h * G) * D, H * D,
                  scratch.data());
            }
        });
      });
    }
  });
  return out;
}

}  // namespace tgi

TORCH_LIBRARY_FRAGMENT(tgi, m) {
  m.def("varlen_prefill(Tensor query, Tensor key, Tensor value, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor cu_seqlens_q, Tensor prefix_lens, float scale, int sliding_window, "
        "float softcap=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(tgi, CPU, m) {
  m.impl("varlen_prefill", tgi::varlen_prefill);
}
#endif
