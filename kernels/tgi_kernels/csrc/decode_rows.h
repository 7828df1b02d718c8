// What the paged decode kernels (attention.cpp's decode_heads_vec,
// decode_bf16.h) share: the rows of the next chunk to prefetch, how they are
// asked for, and how many kv heads one work item takes.
#pragma once

#include <algorithm>
#include <cstdint>

namespace tgi {

// Cache lines to prefetch: the K and V rows of one chunk (lines x 64 bytes from k and v).
struct Rows {
  const char *k = nullptr, *v = nullptr;
  int64_t lines = 0;
};

// The rows of the chunk that starts at token `next` (up to `chunk` tokens
// within its block, before `last`); `after` where next == last (the thread's
// next work item's first chunk). Caches [num_blocks, block_size, ...] of C.
template <typename C>
Rows next_chunk(const C* k_cache, const C* v_cache, int64_t block_stride, int64_t token_stride,
                const int32_t* table, int64_t block_size, int64_t chunk, int64_t next, int64_t last,
                const Rows& after) {
  if (next >= last) return after;
  const int64_t block = table[next / block_size], offset = next % block_size;
  const int64_t tokens = std::min({chunk, block_size - offset, last - next});
  return {reinterpret_cast<const char*>(k_cache + block * block_stride + offset * token_stride),
          reinterpret_cast<const char*>(v_cache + block * block_stride + offset * token_stride),
          (tokens * token_stride * int64_t(sizeof(C)) + 63) / 64};
}

// Query head h of QH's share of `ahead`, asked for into L2. The next chunk's
// block is anywhere in the cache, where the hardware prefetcher cannot
// follow: its rows are asked for while this chunk computes, a share before
// each query head (asked all at once, ~200 lines, they hid far less of the
// misses), and into L2 (prefetcht1): into L1 they filled the core's few L1
// miss buffers and stalled the kernel (docs/architecture.md, "The shard").
inline void prefetch_share(const Rows& ahead, int64_t h, int64_t QH) {
  for (int64_t line = h * ahead.lines / QH; line < (h + 1) * ahead.lines / QH; ++line) {
    __builtin_prefetch(ahead.k + line * 64, 0, 2);
    __builtin_prefetch(ahead.v + line * 64, 0, 2);
  }
}

// kv heads a work item takes: as many as `most` allows, dividing KVH.
inline int64_t heads_per_item(int64_t KVH, int64_t most) {
  int64_t hp = std::max<int64_t>(1, std::min(KVH, most));
  while (KVH % hp) --hp;
  return hp;
}

}  // namespace tgi
