// How the native port answers a call (Complete: every answer, OK or not, goes through it) and the
// counts it keeps of them: calls per status code, the latency histogram over Python's bounds, and
// the refusals since the last look (for the server's rate-limited log). Python reads them through
// `stats` (the port's metrics; with the queue's counts, under mu_) and `refusals` (module.cc).
// Guarded by stats_mu_.
#include "front.h"

#include <algorithm>

namespace expertd::native_front {

void Front::Complete(CallReactor* reactor, const grpc::Status& status, Clock::time_point arrived) {
  const double seconds = std::chrono::duration<double>(Clock::now() - arrived).count();
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    const int raw = static_cast<int>(status.error_code());
    const int code = raw >= 0 && raw < kNumCodes ? raw : static_cast<int>(grpc::StatusCode::UNKNOWN);
    ++handled_[code];
    const size_t bucket = std::lower_bound(latency_bounds.begin(), latency_bounds.end(), seconds) -
                          latency_bounds.begin();
    ++latency_counts_[bucket];
    latency_sum_ += seconds;
    if (!status.ok()) {
      auto& refused = refused_[code];
      ++refused.first;
      refused.second = status.error_message();
    }
  }
  reactor->Answer(status);
}

PyObject* Front::Stats() {
  std::array<int64_t, kNumCodes> handled;
  std::vector<int64_t> counts;
  double sum;
  int64_t queued_tokens, queued_calls, in_flight;
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    handled = handled_;
    counts = latency_counts_;
    sum = latency_sum_;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    queued_tokens = queued_tokens_;
    queued_calls = static_cast<int64_t>(queue_.size());
    in_flight = static_cast<int64_t>(in_flight_.size());
  }
  PyObject* by_code = PyDict_New();
  for (int code = 0; code < kNumCodes; ++code) {
    if (handled[code] == 0) continue;
    PyObject* key = PyLong_FromLong(code);
    PyObject* value = PyLong_FromLongLong(handled[code]);
    PyDict_SetItem(by_code, key, value);
    Py_DECREF(key);
    Py_DECREF(value);
  }
  PyObject* count_list = PyList_New(static_cast<Py_ssize_t>(counts.size()));
  for (size_t i = 0; i < counts.size(); ++i) PyList_SET_ITEM(count_list, i, PyLong_FromLongLong(counts[i]));
  return Py_BuildValue("{s:N,s:(N,d),s:L,s:L,s:L}", "handled", by_code, "latency", count_list, sum,
                       "queued_tokens", static_cast<long long>(queued_tokens), "queued_calls",
                       static_cast<long long>(queued_calls), "batches_in_flight",
                       static_cast<long long>(in_flight));
}

// The error codes answered since the last call: {code: (calls, the latest one's message)}; resets them.
PyObject* Front::Refusals() {
  std::map<int, std::pair<int64_t, std::string>> refused;
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    refused.swap(refused_);
  }
  PyObject* by_code = PyDict_New();
  for (const auto& [code, seen] : refused) {
    PyObject* key = PyLong_FromLong(code);
    PyObject* value = Py_BuildValue("(Ly#)", static_cast<long long>(seen.first), seen.second.data(),
                                    static_cast<Py_ssize_t>(seen.second.size()));
    PyDict_SetItem(by_code, key, value);
    Py_DECREF(key);
    Py_DECREF(value);
  }
  return by_code;
}

void Front::InitStats() { latency_counts_.assign(latency_bounds.size() + 1, 0); }

}  // namespace expertd::native_front
