// The native port's direct runner: a lone call that finds the port idle runs on its own gRPC thread
// through Python's direct callable (the GIL taken there), and what queues behind it runs next on the
// front's one runner thread, batch after batch, while nothing else is in flight; then the queue is
// Python's event loop's again. The state it shares with the queue (direct_, direct_running_, the
// runner's wake-up) is guarded by mu_.
#include "front.h"

#include <thread>

#include <pthread.h>

namespace expertd::native_front {

// Lone calls on an idle port from now on run on their gRPC thread through `direct` (None: never).
// The callable is kept for the process's life, as the front is (a call may be using it).
void Front::SetDirect(PyObject* direct) {
  if (direct != Py_None) Py_INCREF(direct);
  std::lock_guard<std::mutex> lock(mu_);
  direct_ = direct == Py_None ? nullptr : direct;
}

// A lone call that found the port idle (batch `id`, which Forward registered as in flight, this
// thread the direct runner), run on its gRPC thread. If calls queued meanwhile, the run goes on
// on the runner thread, not here: a gRPC callback that blocks holds back what it started, the
// lone call's answer included, until it returns.
void Front::RunDirect(int64_t id) {
  RunOne(id);
  std::unique_lock<std::mutex> lock(mu_);
  if (direct_ != nullptr && !stopping_ && in_flight_.empty() && !queue_.empty()) {
    if (!runner_started_) {
      runner_started_ = true;
      std::thread([this] { RunnerThread(); }).detach();  // lives as the front does: for the process
    }
    runner_wanted_ = true;
    runner_cv_.notify_one();
    return;
  }
  StopRunner(lock);
}

// The runner thread: woken by RunDirect, it runs the direct runner's batches (NextDirect) until
// the runner stops, then waits for the next wake-up.
void Front::RunnerThread() {
  pthread_setname_np(pthread_self(), "expertd-direct");
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      runner_cv_.wait(lock, [this] { return runner_wanted_; });
      runner_wanted_ = false;
    }
    for (int64_t id = NextDirect(); id != 0; id = NextDirect()) RunOne(id);
  }
}

// Batch `id` (in flight, taken by the direct runner) given to the direct callable with take's
// tuple and the GIL held, which answers it with finish or fail, or hands it to the event loop
// (which answers it later). A batch whose callable raises gets INTERNAL; once direct is off,
// UNAVAILABLE.
void Front::RunOne(int64_t id) {
  std::vector<Call> calls;
  PyObject* direct;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = in_flight_.find(id);
    if (it != in_flight_.end()) calls = it->second;  // always found: only the runner has seen `id`
    direct = direct_;
  }
  if (direct == nullptr) {  // stopped since the batch was registered
    if (Release(id, &calls)) {
      for (const Call& call : calls) {
        Complete(call.reactor, grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server is shutting down"),
                 call.arrived);
      }
    }
    return;
  }
  if (calls.empty()) return;
  bool failed = false;
  {
    const PyGILState_STATE gil = PyGILState_Ensure();
    PyObject* args = BatchArgs(id, calls);
    PyObject* result = args == nullptr ? nullptr : PyObject_CallObject(direct, args);
    failed = result == nullptr;
    if (failed) PyErr_WriteUnraisable(direct);
    Py_XDECREF(args);
    Py_XDECREF(result);
    PyGILState_Release(gil);
  }
  if (failed && Release(id, &calls)) {
    for (const Call& call : calls) {
      Complete(call.reactor, grpc::Status(grpc::StatusCode::INTERNAL, "internal error"), call.arrived);
    }
  }
}

// The direct runner's next batch, registered in flight (its id), when it may go on: direct is
// on, nothing is in flight (a batch handed to the event loop ends the run) and calls are queued.
// Every queued call waited for the runner's last batch (its step, answer and record), so they
// merge as calls queued behind a batch do. Else 0: the runner stops, and Python is woken if calls
// are queued.
// The runner does not wait for calls to fill a step (the batcher's queue delay): what queued
// during one step is the next (BENCHMARKS.md, the native port's direct runner).
int64_t Front::NextDirect() {
  std::unique_lock<std::mutex> lock(mu_);
  while (direct_ != nullptr && !stopping_ && in_flight_.empty() && !queue_.empty()) {
    std::vector<Call> calls = NextBatchLocked(lock, /*behind=*/true);
    if (calls.empty()) continue;
    const int64_t id = ++last_batch_;
    in_flight_[id] = std::move(calls);
    return id;
  }
  StopRunner(lock);
  return 0;
}

// The direct runner stops (`lock` holds mu_, and is let go): queued calls wake Python again,
// and those already queued are Python's to take.
void Front::StopRunner(std::unique_lock<std::mutex>& lock) {
  direct_running_ = false;
  const bool wake = !stopping_ && !queue_.empty();
  lock.unlock();
  if (wake) Wake();
}

}  // namespace expertd::native_front
