// Work sharing on XLA:CPU's intra-op thread pool for the expertd custom calls.
//
// ParallelFor(pool, n, work, fn) runs fn(i) for every i in [0, n): tasks are claimed from an atomic
// counter by the calling thread and by up to pool.num_threads() - 1 helper tasks; the caller only
// waits (spinning briefly, then blocking) for tasks already claimed, so it cannot deadlock on a
// busy pool (a helper that starts after all tasks were claimed returns at once). Helpers may
// outlive the call's stack frame, so the shared state is held by shared_ptr and fn is copied into it.
//
// Rule: a call of at most kCallerOnlyWork multiply-adds (`work`, the whole call's) wakes no helper;
// the caller runs every task. A helper woken from sleep joins tens of microseconds in, about what
// such a call takes alone, and spins on its core afterwards: sharing such a call saved at most 17 %
// after an idle gap and cost 1.5-2.4x its CPU (BENCHMARKS.md "ParallelFor trace").
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace expertd {

#ifdef EXPERTD_TRACE_PARALLEL_FOR
// A build with -DEXPERTD_TRACE_PARALLEL_FOR (BuildOptions(trace=True), kernels/cpu/build.py) keeps one
// record per ParallelFor call, steady-clock nanoseconds, for benchmarks/parallel_for_trace.py:
// when the caller started, ran out of tasks and returned; when the first helper started (0: none
// yet) and the last one that ran a task finished (0: none did); the tasks, the caller's share, and
// the helper tasks scheduled. Records past kTraceCapacity are dropped until the next read
// (expertd_parallel_for_trace).
struct ParallelForRecord {
  int64_t start, caller_done, helper_start, helper_done, returned, tasks, caller_tasks, helpers;
};
inline constexpr int64_t kTraceCapacity = 1 << 16;
inline ParallelForRecord trace_records[kTraceCapacity];
inline std::atomic<int64_t> trace_count{0};

inline int64_t TraceNow() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::steady_clock::now().time_since_epoch()).count();
}
#endif

class ParallelForState {
 public:
  ParallelForState(int64_t total, std::function<void(int64_t)> fn) : total_(total), fn_(std::move(fn)) {}

#ifdef EXPERTD_TRACE_PARALLEL_FOR
  std::atomic<int64_t> helper_start_{0}, helper_done_{0};  // set by Run(helper=true)
#endif

  // Claims and runs tasks until none are left, then reports how many this thread ran.
  int64_t Run([[maybe_unused]] bool helper = false) {
#ifdef EXPERTD_TRACE_PARALLEL_FOR
    if (helper) {
      int64_t unset = 0;
      helper_start_.compare_exchange_strong(unset, TraceNow());
    }
#endif
    int64_t finished = 0;
    for (int64_t i; (i = next_.fetch_add(1)) < total_; ++finished) fn_(i);
#ifdef EXPERTD_TRACE_PARALLEL_FOR
    if (helper && finished > 0) helper_done_.store(TraceNow());
#endif
    if (finished == 0) return 0;
    std::lock_guard<std::mutex> lock(mu_);
    if (done_.fetch_add(finished, std::memory_order_release) + finished == total_) all_done_.notify_all();
    return finished;
  }

  // Spins up to kSpinNanos for the helpers' last tasks before sleeping on the condition variable:
  // the rule is that a helper still running when the caller ran out of tasks usually finishes
  // sooner than a wake-up from the condition variable takes, and the caller has nothing else to
  // do (BENCHMARKS.md "ParallelFor trace" has the measurements). A helper that has not
  // started by the time the caller ran out of tasks is never waited for (it claims nothing), so the
  // spin only covers tasks already running.
  void Wait() {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(kSpinNanos);
    while (done_.load(std::memory_order_acquire) != total_) {
      for (int i = 0; i < 64; ++i) _mm_pause();
      if (std::chrono::steady_clock::now() > deadline) {
        std::unique_lock<std::mutex> lock(mu_);
        all_done_.wait(lock, [&] { return done_.load(std::memory_order_acquire) == total_; });
        return;
      }
    }
  }

 private:
  const int64_t total_;
  const std::function<void(int64_t)> fn_;
  std::atomic<int64_t> next_{0};
  static constexpr int64_t kSpinNanos = 100'000;
  std::atomic<int64_t> done_{0};
  std::mutex mu_;
  std::condition_variable all_done_;
};

inline int64_t PoolThreads(xla::ffi::ThreadPool& pool) {
  return std::max<int64_t>(pool.num_threads(), 1);
}

inline constexpr int64_t kCallerOnlyWork = int64_t{1} << 18;

// The rule's bound now: kCallerOnlyWork unless a benchmark set another (expertd_set_caller_only_work).
inline std::atomic<int64_t> caller_only_work{kCallerOnlyWork};

// The threads a call of `work` multiply-adds is shared by (the caller's included): 1 up to
// caller_only_work, else the pool's.
inline int64_t SharingThreads(xla::ffi::ThreadPool& pool, int64_t work) {
  return work > caller_only_work.load(std::memory_order_relaxed) ? PoolThreads(pool) : 1;
}

// fn may capture the caller's locals by reference: it is only ever called before this returns.
inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t total, int64_t work, std::function<void(int64_t)> fn) {
  if (total <= 0) return;
  auto state = std::make_shared<ParallelForState>(total, std::move(fn));
  const int64_t helpers = std::min(SharingThreads(pool, work), total) - 1;
#ifdef EXPERTD_TRACE_PARALLEL_FOR
  const int64_t start = TraceNow();
#endif
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([state] { state->Run(/*helper=*/true); });
  const int64_t caller_tasks = state->Run();
#ifdef EXPERTD_TRACE_PARALLEL_FOR
  const int64_t caller_done = TraceNow();
#endif
  state->Wait();
#ifdef EXPERTD_TRACE_PARALLEL_FOR
  const int64_t slot = trace_count.fetch_add(1);
  if (slot < kTraceCapacity) {
    // A helper still starting (it will claim nothing) may set helper_start_ after this read.
    trace_records[slot] = {start, caller_done, state->helper_start_.load(), state->helper_done_.load(),
                           TraceNow(), total, caller_tasks, helpers};
  }
#else
  (void)caller_tasks;
#endif
}

}  // namespace expertd
