// Work sharing on XLA:CPU's intra-op thread pool for the expertd custom calls.
//
// ParallelFor(pool, n, fn) runs fn(i) for every i in [0, n): tasks are claimed from an atomic
// counter by the calling thread and by up to pool.num_threads() - 1 helper tasks; the caller only
// waits for tasks already claimed, so it cannot deadlock on a busy pool (a helper that starts after
// all tasks were claimed returns at once). Helpers may outlive the call's stack frame, so the
// shared state is held by shared_ptr and fn is copied into it.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace expertd {

class ParallelForState {
 public:
  ParallelForState(int64_t total, std::function<void(int64_t)> fn) : total_(total), fn_(std::move(fn)) {}

  // Claims and runs tasks until none are left, then reports how many this thread ran.
  void Run() {
    int64_t finished = 0;
    for (int64_t i; (i = next_.fetch_add(1)) < total_; ++finished) fn_(i);
    if (finished == 0) return;
    std::lock_guard<std::mutex> lock(mu_);
    done_ += finished;
    if (done_ == total_) all_done_.notify_all();
  }

  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    all_done_.wait(lock, [&] { return done_ == total_; });
  }

 private:
  const int64_t total_;
  const std::function<void(int64_t)> fn_;
  std::atomic<int64_t> next_{0};
  int64_t done_ = 0;
  std::mutex mu_;
  std::condition_variable all_done_;
};

inline int64_t PoolThreads(xla::ffi::ThreadPool& pool) {
  return std::max<int64_t>(pool.num_threads(), 1);
}

// fn may capture the caller's locals by reference: it is only ever called before this returns.
inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t total, std::function<void(int64_t)> fn) {
  if (total <= 0) return;
  auto state = std::make_shared<ParallelForState>(total, std::move(fn));
  const int64_t helpers = std::min(PoolThreads(pool), total) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([state] { state->Run(); });
  state->Run();
  state->Wait();
}

}  // namespace expertd
