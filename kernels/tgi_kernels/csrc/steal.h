// parallel_steal: [0, n) split over the threads as at::parallel_for splits
// it, each thread taking its own share item by item from the front, and a
// thread whose share is done taking the back half of what another has
// left. A thread the OS preempts (the router, the load generator or another
// process wanting the core) then holds up only the item it is on while the
// others take the rest of its share; with static shares they finished
// theirs and spun at the barrier until it ran again. Which thread computes
// an item never changes its result, so outputs stay bitwise the same
// (figures: docs/tuning.md#work-stealing). (The thread still holding an item
// when it is preempted keeps the region open until it runs again: that part
// of the loss stays.)
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace tgi {

namespace steal_detail {
// One thread's remaining items [begin, end) in one word, so that the owner
// (from the front) and a thief (from the back) each move it with one CAS.
struct alignas(64) Range {
  std::atomic<uint64_t> word;
};
inline uint64_t pack(uint32_t begin, uint32_t end) { return uint64_t(end) << 32 | begin; }
inline uint32_t begin_of(uint64_t w) { return uint32_t(w); }
inline uint32_t end_of(uint64_t w) { return uint32_t(w >> 32); }
}  // namespace steal_detail

// fn(i) for every i in [0, n), each exactly once, over at most
// at::get_num_threads() threads; serial where one thread or one item.
template <typename F>
void parallel_steal(int64_t n, const F& fn) {
  using namespace steal_detail;
  TORCH_CHECK(n < (int64_t(1) << 32), "parallel_steal packs item indices in 32 bits");
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::vector<Range> ranges(threads);
  for (int64_t t = 0; t < threads; ++t)
    ranges[t].word.store(pack(uint32_t(n * t / threads), uint32_t(n * (t + 1) / threads)), std::memory_order_relaxed);
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      std::atomic<uint64_t>& own = ranges[t].word;
      while (true) {
        uint64_t w = own.load(std::memory_order_acquire);
        while (begin_of(w) < end_of(w)) {
          if (own.compare_exchange_weak(w, pack(begin_of(w) + 1, end_of(w)), std::memory_order_acq_rel)) {
            fn(int64_t(begin_of(w)));
            w = own.load(std::memory_order_acquire);
          }
        }
        // Own share done: the back half of the largest share left, if any.
        bool stole = false;
        while (!stole) {
          int64_t victim = -1;
          uint32_t most = 0;
          for (int64_t v = 0; v < threads; ++v) {
            const uint64_t vw = ranges[v].word.load(std::memory_order_acquire);
            if (v != t && end_of(vw) > begin_of(vw) && end_of(vw) - begin_of(vw) > most) {
              most = end_of(vw) - begin_of(vw);
              victim = v;
            }
          }
          if (victim < 0) break;
          uint64_t vw = ranges[victim].word.load(std::memory_order_acquire);
          const uint32_t b = begin_of(vw), e = end_of(vw);
          if (b >= e) continue;
          const uint32_t mid = e - (e - b + 1) / 2;
          if (ranges[victim].word.compare_exchange_strong(vw, pack(b, mid), std::memory_order_acq_rel)) {
            own.store(pack(mid, e), std::memory_order_release);
            stole = true;
          }
        }
        if (!stole) break;
      }
    }
  });
}

}  // namespace tgi
