// Paged decode attention that reads each sequence's blocks in place, and the
// rotary + KV-store step that precedes it. The torch path gathers every
// sequence's blocks, padded to the longest context, into a dense copy and
// runs SDPA with a mask, an order of magnitude slower (figures:
// docs/tuning.md#cpu-paged-decode-attention).
#include "common.h"
#include "decode_bf16.h"
#include "decode_rows.h"
#include "fp8.h"
#include "steal.h"
#include "vec.h"

#include <cmath>
#include <limits>
#include <type_traits>

namespace tgi {
namespace {

constexpr int64_t kMaxGroup = 16, kMaxHeadDim = 256, kMaxBlock = 256;

// One step of the online softmax: the n scores s of a chunk become
// exp(s - new max) in place, the running max m and sum l move on, and the
// factor by which values accumulated so far must be rescaled is returned.
template <typename A>
inline A online_softmax(A* s, int64_t n, A& m, A& l) {
  A mx = m;
  for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
  // The first chunk rescales nothing: the accumulators and l are still 0.
  const A correction = m == -std::numeric_limits<A>::infinity() ? A(0) : exp_approx(m - mx);
  A total = 0;
#pragma omp simd reduction(+ : total)
  for (int64_t t = 0; t < n; ++t) {
    s[t] = exp_approx(s[t] - mx);
    total += s[t];
  }
  l = l * correction + total;
  m = mx;
  return correction;
}

// One (sequence, kv head): the G query heads that share the kv head read
// its K/V rows once, block by block, with an online softmax; each row is
// widened to acc_t once for all G heads. Everything is on the stack (G <= 16,
// D <= 256, block_size <= 256: checked by the caller). kD: the head dim as a
// compile-time constant (64 and 128, where the loops unroll), or 0. C: the
// cache's element type (T, or fp8: fp8.h).
template <typename T, typename C, int64_t kD>
void decode_one(const T* q, const C* k_cache, const C* v_cache, int64_t block_stride, int64_t token_stride,
                const int32_t* table, int64_t block_size, int64_t first, int64_t last, int64_t G,
                int64_t head_dim, double scale, double softcap, T* out) {
  using A = acc_t<T>;
  const int64_t D = kD ? kD : head_dim;
  A row[kMaxHeadDim];
  A qf[kMaxGroup * kMaxHeadDim], acc[kMaxGroup * kMaxHeadDim], m[kMaxGroup], l[kMaxGroup];
  A s[kMaxGroup * kMaxBlock];
  for (int64_t g = 0; g < G; ++g) {
    m[g] = -std::numeric_limits<A>::infinity();
    l[g] = 0;
    for (int64_t d = 0; d < D; ++d) {
      qf[g * D + d] = ld(q[g * D + d]) * A(scale);
      acc[g * D + d] = 0;
    }
  }
  for (int64_t start = first - first % block_size; start < last; start += block_size) {
    const int64_t block = table[start / block_size];
    const int64_t t0 = std::max(start, first), n = std::min(start + block_size, last) - t0;
    const C* kb = k_cache + block * block_stride + (t0 - start) * token_stride;
    const C* vb = v_cache + block * block_stride + (t0 - start) * token_stride;
    for (int64_t t = 0; t < n; ++t) {
      const C* kr = kb + t * token_stride;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) row[d] = ld(kr[d]);
      for (int64_t g = 0; g < G; ++g) {
        const A* qg = qf + g * D;
        A dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * row[d];
        s[g * block_size + t] = softcap > 0 ? soft_cap(dot, A(softcap)) : dot;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const A correction = online_softmax(s + g * block_size, n, m[g], l[g]);
      A* ag = acc + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] *= correction;
    }
    for (int64_t t = 0; t < n; ++t) {
      const C* vr = vb + t * token_stride;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) row[d] = ld(vr[d]);
      for (int64_t g = 0; g < G; ++g) {
        const A p = s[g * block_size + t];
        A* ag = acc + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] += p * row[d];
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const A inv = A(1) / l[g];
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = st<T>(acc[g * D + d] * inv);
  }
}

// decode_one over hp consecutive kv heads of one sequence (the plain path
// always gets hp = 1): the signature decode_heads_vec shares. `after`: the
// first chunk of the thread's next work item (decode_heads_vec prefetches it).
template <typename T, typename C, int64_t kD>
void decode_heads(const T* q, const C* k_cache, const C* v_cache, int64_t block_stride, int64_t token_stride,
                  const int32_t* table, int64_t block_size, int64_t first, int64_t last, int64_t hp, int64_t G,
                  int64_t head_dim, double scale, double softcap, T* out, const Rows& /*after*/) {
  for (int64_t i = 0; i < hp; ++i)
    decode_one<T, C, kD>(q + i * G * head_dim, k_cache + i * head_dim, v_cache + i * head_dim, block_stride,
                      token_stride, table, block_size, first, last, G, head_dim, scale, softcap,
                      out + i * G * head_dim);
}

#if TGI_VEC
// decode_one with explicit vectors (vec.h), for head_dim a multiple of the
// vector width, over `hp` consecutive kv heads of one sequence at once: each
// chunk of up to kChunk tokens of one block is then one contiguous run of
// the cache ([tokens, hp heads, D]), widened to float once; each query head
// takes a dot product per key (one horizontal sum each) and accumulates the
// values with the softmax rescale folded into the first multiply: faster
// than decode_one a kv head (figures: docs/tuning.md#cpu-paged-decode-attention).
constexpr int64_t kChunk = 16, kMaxRow = 1024;  // floats of one token's hp heads

template <typename T, typename C, int64_t kD>
void decode_heads_vec(const T* q, const C* k_cache, const C* v_cache, int64_t block_stride, int64_t token_stride,
                      const int32_t* table, int64_t block_size, int64_t first, int64_t last, int64_t hp, int64_t G,
                      int64_t head_dim, double scale, double softcap, T* out, const Rows& after) {
  using namespace vec;
  constexpr bool kFloat = std::is_same_v<C, float>;  // rows read in place, not widened
  const int64_t D = kD ? kD : head_dim, nj = D / kWidth, QH = hp * G, row = hp * D;
  alignas(64) float qf[kMaxGroup * kMaxHeadDim], acc[kMaxGroup * kMaxHeadDim];
  alignas(64) float kbuf[kFloat ? 1 : kChunk * kMaxRow], vbuf[kFloat ? 1 : kChunk * kMaxRow];
  float s[kChunk], m[kMaxGroup], l[kMaxGroup];
  const float* krow[kChunk];
  const float* vrow[kChunk];
  for (int64_t h = 0; h < QH; ++h) {
    m[h] = -std::numeric_limits<float>::infinity();
    l[h] = 0;
    for (int64_t d = 0; d < D; ++d) {
      qf[h * D + d] = ld(q[h * D + d]) * float(scale);
      acc[h * D + d] = 0;
    }
  }
  for (int64_t t0 = first; t0 < last;) {
    const int64_t block = table[t0 / block_size], offset = t0 % block_size;
    const int64_t n = std::min({kChunk, block_size - offset, last - t0});
    const C* kb = k_cache + block * block_stride + offset * token_stride;
    const C* vb = v_cache + block * block_stride + offset * token_stride;
    // The next chunk's rows (the last chunk's: the next work item's first), asked for a share a head.
    const Rows ahead = next_chunk(k_cache, v_cache, block_stride, token_stride, table, block_size, kChunk, t0 + n,
                                  last, after);
    for (int64_t t = 0; t < n; ++t) {
      if constexpr (kFloat) {
        krow[t] = kb + t * token_stride;
        vrow[t] = vb + t * token_stride;
      } else {
        float* kw = kbuf + t * row;
        float* vw = vbuf + t * row;
        widen(kb + t * token_stride, kw, row);
        widen(vb + t * token_stride, vw, row);
        krow[t] = kw;
        vrow[t] = vw;
      }
    }
    for (int64_t h = 0; h < QH; ++h) {
      prefetch_share(ahead, h, QH);
      const int64_t kv = (h / G) * D;  // this query head's kv head, within a row
      const float* qh = qf + h * D;
      float correction;
      if (kD != 0 && n == kChunk && softcap == 0) {
        // A whole chunk: 16 dot products as 16 vectors of partial sums, then
        // transpose-reduces (lane_sums: one with AVX-512, two with AVX2) give
        // the 16 scores, whose online softmax step stays in registers (the
        // scalar loop's call took much of the kernel's time:
        // docs/tuning.md#cpu-paged-decode-attention).
        constexpr int64_t kV = kChunk / kWidth;  // score vectors: 1 (AVX-512) or 2 (AVX2)
        R a[kChunk], scores[kV];
#pragma GCC unroll 16
        for (int64_t t = 0; t < kChunk; ++t) {
          const float* kr = krow[t] + kv;
          R x = mul(load(qh), load(kr));
#pragma GCC unroll 8
          for (int64_t j = 1; j < nj; ++j) x = fma(load(qh + j * kWidth), load(kr + j * kWidth), x);
          a[t] = x;
        }
        R top = scores[0] = lane_sums(a);
        for (int64_t v = 1; v < kV; ++v) top = max(top, scores[v] = lane_sums(a + v * kWidth));
        const float mx = std::max(m[h], hmax(top));
        // The first chunk rescales nothing: the accumulators and l are still 0.
        // (exp_approx is not inlined here: a call per head and chunk cost ~15% of the kernel)
        correction = m[h] == -std::numeric_limits<float>::infinity() ? 0.0f : lane0(exp(set1(m[h] - mx)));
        R total = set1(0.0f);
        for (int64_t v = 0; v < kV; ++v) {
          const R p = exp(sub(scores[v], set1(mx)));
          total = add(total, p);
          store(s + v * kWidth, p);
        }
        l[h] = l[h] * correction + sum(total);
        m[h] = mx;
      } else
      {
        for (int64_t t = 0; t < n; ++t) {
          const float* kr = krow[t] + kv;
          R a = mul(load(qh), load(kr));
          for (int64_t j = 1; j < nj; ++j) a = fma(load(qh + j * kWidth), load(kr + j * kWidth), a);
          s[t] = softcap > 0 ? soft_cap(sum(a), float(softcap)) : sum(a);
        }
        correction = online_softmax(s, n, m[h], l[h]);
      }
      float* ah = acc + h * D;
      const R c = set1(correction);
      if constexpr (kD != 0) {
        // Up to 8 of the head's D / kWidth accumulators side by side: that
        // many independent FMA chains over the chunk's tokens (one chain a
        // vector kept the FMA latency, not its throughput, as the limit).
        constexpr int64_t kJ = kD / kWidth, kStep = kJ < 8 ? kJ : 8;
        for (int64_t j0 = 0; j0 < kJ; j0 += kStep) {
          R a[kStep];
#pragma GCC unroll 8
          for (int64_t j = 0; j < kStep; ++j) a[j] = mul(load(ah + (j0 + j) * kWidth), c);
          for (int64_t t = 0; t < n; ++t) {
            const R p = set1(s[t]);
            const float* vr = vrow[t] + kv + j0 * kWidth;
#pragma GCC unroll 8
            for (int64_t j = 0; j < kStep; ++j) a[j] = fma(p, load(vr + j * kWidth), a[j]);
          }
#pragma GCC unroll 8
          for (int64_t j = 0; j < kStep; ++j) store(ah + (j0 + j) * kWidth, a[j]);
        }
      } else {
        for (int64_t j = 0; j < nj; ++j) {
          R a = mul(load(ah + j * kWidth), c);
          for (int64_t t = 0; t < n; ++t) a = fma(set1(s[t]), load(vrow[t] + kv + j * kWidth), a);
          store(ah + j * kWidth, a);
        }
      }
    }
    t0 += n;
  }
  for (int64_t h = 0; h < QH; ++h) {
    const float inv = 1.0f / l[h];
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = st<T>(acc[h * D + d] * inv);
  }
}
#endif

#ifdef TGI_BF16_GEMM
// decode_bf16::heads in decode_heads' signature (softcap is 0 there: checked by the caller).
template <int64_t kD, typename C>
void decode_heads_bf16(const c10::BFloat16* q, const C* k_cache, const C* v_cache,
                       int64_t block_stride, int64_t token_stride, const int32_t* table, int64_t block_size,
                       int64_t first, int64_t last, int64_t hp, int64_t G, int64_t /*head_dim*/, double scale,
                       double /*softcap*/, c10::BFloat16* out, const Rows& after) {
  decode_bf16::heads<kD>(q, k_cache, v_cache, block_stride, token_stride, table, block_size, first, last, hp, G,
                         scale, out, after);
}
#endif

// x[0..D) @ key_rotation(D) (tgi_kernels/fp8.py), in place: the
// Walsh-Hadamard transform of each block of n = D & -D values (Sylvester's
// order, the butterflies of width below n never cross a block), times
// 2^-floor(log2(n) / 2). n log2(n) adds a block against a matmul's n^2.
template <typename A>
inline void turn(A* x, int64_t D) {
  const int64_t n = D & -D;
  const A scale = A(1) / A(int64_t(1) << ((63 - __builtin_clzll(uint64_t(n))) / 2));
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<A, float>) {
    if (n >= 16) {  // 16 floats a register: butterflies of width 1-8 within one, 16 and up across
      const __m512 upper_1 = _mm512_castsi512_ps(_mm512_set1_epi64(int64_t(0x8000000000000000)));
      constexpr int F = int(0x80000000u);  // a lane's sign bit; the sets list lanes from the top down
      const __m512i by2 = _mm512_set_epi32(F, F, 0, 0, F, F, 0, 0, F, F, 0, 0, F, F, 0, 0);
      const __m512i by4 = _mm512_set_epi64(int64_t(0x8000000080000000), int64_t(0x8000000080000000), 0, 0,
                                           int64_t(0x8000000080000000), int64_t(0x8000000080000000), 0, 0);
      const __m512i by8 = _mm512_set_epi64(int64_t(0x8000000080000000), int64_t(0x8000000080000000),
                                           int64_t(0x8000000080000000), int64_t(0x8000000080000000), 0, 0, 0, 0);
      // y_i = x_(i ^ len) + (bit len of i ? -x_i : x_i): the partner, plus x with the upper half's sign flipped.
      auto step = [](__m512 v, __m512 partner, __m512i flip) {
        return _mm512_add_ps(partner, _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), flip)));
      };
      for (int64_t r = 0; r < D; r += 16) {
        __m512 v = _mm512_loadu_ps(x + r);
        v = step(v, _mm512_permute_ps(v, 0xB1), _mm512_castps_si512(upper_1));
        v = step(v, _mm512_permute_ps(v, 0x4E), by2);
        v = step(v, _mm512_shuffle_f32x4(v, v, 0xB1), by4);
        v = step(v, _mm512_shuffle_f32x4(v, v, 0x4E), by8);
        _mm512_storeu_ps(x + r, v);
      }
      for (int64_t len = 16; len < n; len <<= 1)
        for (int64_t i = 0; i < D; i += 2 * len)
          for (int64_t j = i; j < i + len; j += 16) {
            const __m512 a = _mm512_loadu_ps(x + j), b = _mm512_loadu_ps(x + j + len);
            _mm512_storeu_ps(x + j, _mm512_add_ps(a, b));
            _mm512_storeu_ps(x + j + len, _mm512_sub_ps(a, b));
          }
      for (int64_t r = 0; r < D; r += 16)
        _mm512_storeu_ps(x + r, _mm512_mul_ps(_mm512_loadu_ps(x + r), _mm512_set1_ps(scale)));
      return;
    }
  }
#endif
  for (int64_t len = 1; len < n; len <<= 1) {
    for (int64_t i = 0; i < D; i += 2 * len) {
#pragma omp simd
      for (int64_t j = i; j < i + len; ++j) {
        const A a = x[j], b = x[j + len];
        x[j] = a + b;
        x[j + len] = a - b;
      }
    }
  }
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) x[d] *= scale;
}

// One token of rotary_store_kv: x [H + 2 KVH, D] rotated in place for the
// first H + KVH heads (and turned by key_rotation where `turned`); its key
// and value heads written to the token's slots (divided by their scales and
// rounded where C is fp8).
template <typename T, typename C>
void rotary_store_row(T* x, const T* c, const T* s, int64_t num_heads, int64_t KVH, int64_t D, C* k_slot,
                      C* v_slot, float k_inv_scale, float v_inv_scale, bool turned) {
  using A = acc_t<T>;
  const int64_t half = D / 2;
  A row[512], out[512];  // head_dim <= 512, checked by the caller
  for (int64_t h = 0; h < num_heads + KVH; ++h) {
    T* r = x + h * D;
    for (int64_t d = 0; d < D; ++d) row[d] = ld(r[d]);
#pragma omp simd
    for (int64_t d = 0; d < half; ++d) {
      out[d] = row[d] * ld(c[d]) + row[d + half] * ld(s[d]);
      out[d + half] = row[d + half] * ld(c[d + half]) + row[d] * ld(s[d + half]);
    }
    if (turned) {  // the rotated row rounded to T first, as the unfused path's
      for (int64_t d = 0; d < D; ++d) out[d] = ld(st<T>(out[d]));
      turn(out, D);
    }
    for (int64_t d = 0; d < D; ++d) r[d] = st<T>(out[d]);
  }
  const T* k = x + num_heads * D;
  narrow(k, k_slot, KVH * D, k_inv_scale);
  narrow(k + KVH * D, v_slot, KVH * D, v_inv_scale);
}

}  // namespace

// query [B, H, D] (rows may be strided, heads and dims contiguous);
// k_cache/v_cache [num_blocks, block_size, KVH, D] contiguous, holding the
// current token, in query's dtype or fp8 (read as its float value: the
// caller folds any cache scale into `scale` and the output); block_tables
// [B, W] int32; seq_lens [B] int32 counting the current token. Query b sits
// at seq_lens[b] - 1 and sees keys j with seq_lens[b] - window <= j
// (window > 0) and j < seq_lens[b]. softcap > 0
// (gemma2): each scaled score s becomes softcap * tanh(s / softcap). -> [B, H, D].
at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                        int64_t sliding_window, double softcap) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query must be [B, H, D] with contiguous heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
              k_cache.sizes() == v_cache.sizes(), "caches must be contiguous [num_blocks, block_size, KVH, D]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
              block_tables.is_contiguous() && seq_lens.is_contiguous(), "block_tables and seq_lens must be int32");
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t block_size = k_cache.size(1), KVH = k_cache.size(2), G = H / KVH;
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0, "head dims or counts do not match");
  TORCH_CHECK(G <= kMaxGroup && D <= kMaxHeadDim && block_size <= kMaxBlock,
              "at most 16 query heads per kv head, head_dim 256 and block_size 256");
  auto out = at::empty({B, H, D}, query.options());
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  const int64_t width = block_tables.size(1);
  int64_t work = 0;  // key rows read, all sequences
  for (int64_t b = 0; b < B; ++b) work += lens[b];
  TGI_DISPATCH(query.scalar_type(), "paged_decode", [&] {
    dispatch_cache<scalar_t>(k_cache.scalar_type(), [&](auto cache_tag) {
      using C = decltype(cache_tag);
      const scalar_t* qp = query.const_data_ptr<scalar_t>();
      const C* kp = static_cast<const C*>(k_cache.const_data_ptr());
      const C* vp = static_cast<const C*>(v_cache.const_data_ptr());
      scalar_t* op = out.mutable_data_ptr<scalar_t>();
      // Few keys in all: stay on this thread rather than wake the pool.
      const bool small = work * H * D < (1 << 17);
      // Work items of hp kv heads of one sequence: the plain kernel takes one,
      // the vector kernel as many as its stack buffers hold (hp * G query
      // heads, hp * D floats a token).
      int64_t hp = 1;
      auto one = D == 64 ? decode_heads<scalar_t, C, 64>
               : D == 128 ? decode_heads<scalar_t, C, 128> : decode_heads<scalar_t, C, 0>;
#if TGI_VEC
      if constexpr (!std::is_same_v<scalar_t, double>) {
        if (D % vec::kWidth == 0) {
          hp = heads_per_item(KVH, std::min(kMaxGroup / G, kMaxRow / D));
          one = D == 64 ? decode_heads_vec<scalar_t, C, 64>
              : D == 128 ? decode_heads_vec<scalar_t, C, 128> : decode_heads_vec<scalar_t, C, 0>;
        }
      }
#endif
#ifdef TGI_BF16_GEMM
      // bf16 query and cache: rows read as bf16 by vdpbf16ps (decode_bf16.h).
      // An fp8 cache's rows are turned into bf16 (exactly) a chunk at a time, into
      // buffers of kMaxConverted elements a token.
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && decode_bf16::kReadsCache<C>) {
        if ((D == 64 || D == 128) && softcap == 0) {
          const int64_t most = decode_bf16::kMaxHeads / G;
          hp = heads_per_item(KVH, kIsFp8<C> ? std::min(most, decode_bf16::kMaxConverted / D) : most);
          one = D == 64 ? decode_heads_bf16<64, C> : decode_heads_bf16<128, C>;
        }
      }
#endif
      const int64_t parts = KVH / hp;
      auto first_key = [&](int64_t b) {
        return sliding_window > 0 ? std::max<int64_t>(0, lens[b] - sliding_window) : int64_t(0);
      };
      const int64_t items = B * parts;
      auto item = [&](int64_t i) {
        const int64_t b = i / parts, h = (i % parts) * hp;
        // The next item, the one this thread most likely takes next (the
        // front of its share): its first chunk's lines, prefetched meanwhile.
        Rows after;
        if (i + 1 < items) {
          const int64_t nb = (i + 1) / parts, nh = ((i + 1) % parts) * hp, nf = first_key(nb);
          const int64_t offset = (int64_t(tables[nb * width + nf / block_size]) * block_size + nf % block_size) * KVH * D
                                 + nh * D;
          // its first chunk: up to 16 tokens (decode_heads_vec's kChunk) within its first block
          const int64_t tokens = std::min<int64_t>({16, block_size - nf % block_size, lens[nb] - nf});
          after = {reinterpret_cast<const char*>(kp + offset), reinterpret_cast<const char*>(vp + offset),
                   (((tokens - 1) * KVH * D + hp * D) * int64_t(sizeof(C)) + 63) / 64};
        }
        one(qp + b * query.stride(0) + h * G * D, kp + h * D, vp + h * D, block_size * KVH * D, KVH * D,
            tables + b * width, block_size, first_key(b), lens[b], hp, G, D, scale, softcap, op + (b * H + h * G) * D,
            after);
      };
      if (small) {
        for (int64_t i = 0; i < items; ++i) item(i);
      } else {
        parallel_steal(items, item);
      }
    });
  });
  return out;
}

// In place: rotates the query and key heads of qkv [T, H + 2 KVH, D]
// (Hugging Face's rotate-half: x * cos + roll(x, D/2) * signed_sin, with
// cos/signed_sin [T, D] as RotaryEmbedding.cos_sin gives them), then writes
// each token's key and value heads into k_cache/v_cache
// [num_blocks, block_size, KVH, D] at slot_mapping [T] int64. Caches in
// fp8 hold key / k_scale and value / v_scale, rounded to nearest even and
// saturated; caches in qkv's dtype hold them as they are (scales 1).
// key_rotation: the rotated query and key heads are then turned by
// key_rotation(D) (tgi_kernels/fp8.py), keys stored turned.
void rotary_store_kv(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                     at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping, double k_scale,
                     double v_scale, bool key_rotation) {
  TORCH_CHECK(qkv.is_contiguous() && qkv.dim() == 3, "qkv must be a contiguous [T, H + 2 KVH, D] tensor");
  const int64_t T = qkv.size(0), heads = qkv.size(1), D = qkv.size(2), KVH = (heads - num_heads) / 2;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * D && sin.numel() == T * D &&
              cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "cos/sin must be contiguous [T, D] in qkv's dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(2) == KVH && k_cache.size(3) == D &&
              k_cache.scalar_type() == v_cache.scalar_type(),
              "caches must be contiguous [num_blocks, block_size, KVH, D] of one dtype");
  TORCH_CHECK(k_scale > 0 && v_scale > 0 &&
              (k_cache.scalar_type() != qkv.scalar_type() || (k_scale == 1 && v_scale == 1)),
              "KV scales must be positive, and 1 unless the cache is fp8");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == T && slot_mapping.is_contiguous(),
              "slot_mapping must be [T] int64");
  TORCH_CHECK(D <= 512 && D % 2 == 0, "head_dim must be even and at most 512");
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < slots, "slot out of range");
  TGI_DISPATCH(qkv.scalar_type(), "rotary_store_kv", [&] {
    dispatch_cache<scalar_t>(k_cache.scalar_type(), [&](auto cache_tag) {
      using C = decltype(cache_tag);
      scalar_t* x = qkv.mutable_data_ptr<scalar_t>();
      const scalar_t* cp = cos.const_data_ptr<scalar_t>();
      const scalar_t* sn = sin.const_data_ptr<scalar_t>();
      C* kc = static_cast<C*>(k_cache.mutable_data_ptr());
      C* vc = static_cast<C*>(v_cache.mutable_data_ptr());
      const float k_inv = float(1.0 / k_scale), v_inv = float(1.0 / v_scale);
      at::parallel_for(0, T, grain_rows(heads * D), [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t)
          rotary_store_row(x + t * heads * D, cp + t * D, sn + t * D, num_heads, KVH, D, kc + sp[t] * KVH * D,
                           vc + sp[t] * KVH * D, k_inv, v_inv, key_rotation);
      });
    });
  });
}

}  // namespace tgi

TORCH_LIBRARY_FRAGMENT(tgi, m) {
  m.def("paged_decode(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale, int sliding_window, float softcap=0.0) -> Tensor");
  m.def("rotary_store_kv(Tensor(a!) qkv, Tensor cos, Tensor sin, int num_heads, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, Tensor slot_mapping, float k_scale=1.0, float v_scale=1.0, bool key_rotation=False) -> ()");
}

TORCH_LIBRARY_IMPL(tgi, CPU, m) {
  m.impl("paged_decode", tgi::paged_decode);
  m.impl("rotary_store_kv", tgi::rotary_store_kv);
}
