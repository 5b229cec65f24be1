// expertd's native Forward port: gRPC C++ serves expertd.v1.ExpertService/Forward (and
// GetModelInfo, and grpc.health.v1) with no Python per call. A Python extension module,
// `expertd_native_front`; its one user is expertd/server/native_front/front.py, which says what the
// port does and does not serve.
//
// Per call, on gRPC's own threads: the bearer token (when one is set; constant-time comparison), the
// body (bytes that do not parse as a ForwardRequest: INVALID_ARGUMENT, as on the main port),
// whether the server is accepting (else UNAVAILABLE with the reason Python gave), the request's
// fields (NOT_FOUND for a layer not served, INVALID_ARGUMENT naming the field: dtype, shape, the
// token limit, byte length, token ids, NaN / Inf), the bounds on queued tokens and calls
// (RESOURCE_EXHAUSTED). Refusals carry the main port's rich details (google.rpc.Status in
// grpc-status-details-bin): a BadRequest field violation with INVALID_ARGUMENT, a RetryInfo delay
// with RESOURCE_EXHAUSTED (the tokens over the bound, or one queued call's tokens for the call
// bound, at the seconds per token Python last gave; at least its minimum). An accepted call joins
// one FIFO queue; a call that finds the queue empty signals an eventfd. The server's event loop
// watches that fd; woken, it reads it and takes batches (one a loop turn) until none is left:
// calls of one (layer, dtype, with or without token ids), in arrival order, up to
// `max_batch_tokens` rows (a larger call alone; with no batch in flight, a call that arrived after
// the last batch was answered alone), their rows concatenated. Where Python gave a direct callable
// (`set_direct`), a call that finds nothing queued or in flight skips the queue and the event loop:
// it becomes a batch of its own at once, and its gRPC thread calls `direct` with the GIL held (the
// arguments `take` would return), which answers it. The direct runner is then on: queued calls do
// not signal the eventfd, and if any queued during that step, the front's runner thread takes them
// as its next batch, and so on while nothing else is in flight (RunDirect). Python answers a batch with
// `finish` (the output rows in the callers' dtype, split back per call) or `fail` (one status for
// each of its calls). Calls cancelled or past their deadline while queued are answered CANCELLED
// when a take meets them, not run.
//
// Python API (every function takes the handle `start` returned; fronts live until the process ends):
//   start(address, layers: dict[int, int] (layer -> H), max_request_tokens, max_batch_tokens,
//         max_queued_tokens, max_queued_calls, max_message_bytes, model_info: bytes (a serialized
//         GetModelInfoResponse), token: bytes | None, tls: (key, chain, client_ca | None) | None,
//         latency_bounds: sequence of float, not_ready: str (why calls are refused until
//         set_accepting)) -> (handle, port, ready_fd)
//   set_accepting(handle, accepting: bool, reason: str)   also sets health SERVING / NOT_SERVING
//   set_model_info(handle, model_info: bytes)   GetModelInfo's answer from now on (a serialized
//                  GetModelInfoResponse: the main port's, when an expert placement changes)
//   set_retry_hint(handle, seconds_per_token: dict[int, float] (layer -> s), min_s: float)
//                  what a RESOURCE_EXHAUSTED refusal's RetryInfo delay is computed from
//   set_direct(handle, direct: callable | None)   direct(batch, layer, dtype, rows, token_ids, remaining_s)
//                  for the direct runner's batches (RunDirect), called on a gRPC thread; it must
//                  answer the batch (finish, fail, or later from the event loop); None: every call
//                  is queued
//   take(handle) -> (batch, layer, dtype, rows: bytes, token_ids: bytes | None,
//                    seconds to the latest caller's deadline | None) | None
//                  never waits: None when nothing is queued, or once stopped
//   finish(handle, batch, output: buffer)   [rows, H] in the batch's dtype
//   fail(handle, batch, code: int, message: str, details: bytes)   details: a google.rpc.Status
//   stats(handle) -> dict   {"handled": {code: n}, "latency": ([counts], sum), "queued_tokens": n,
//                            "queued_calls": n, "batches_in_flight": n}
//   refusals(handle) -> {code: (n, last message: bytes)}   the calls answered with each error code since
//                  the last call, and the latest one's message (for the server's rate-limited log)
//   stop(handle, grace_s)   refuses what is queued (UNAVAILABLE), then shuts the port down,
//                           cancelling calls still unanswered after grace_s
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <google/protobuf/stubs/logging.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <sys/eventfd.h>
#include <unistd.h>

#include "expertd/v1/expert.grpc.pb.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"

namespace {

using expertd::v1::ForwardRequest;
using expertd::v1::ForwardResponse;
using Clock = std::chrono::steady_clock;

constexpr int kNumCodes = 17;  // grpc::StatusCode values 0..16

// `code` and `message` with `detail` packed into a google.rpc.Status, as the main port sends its
// refusals (the client reads field violations and retry delays from it).
grpc::Status RichStatus(grpc::StatusCode code, const std::string& message, const google::protobuf::Message& detail) {
  google::rpc::Status status;
  status.set_code(static_cast<int32_t>(code));
  status.set_message(message);
  status.add_details()->PackFrom(detail);
  return grpc::Status(code, message, status.SerializeAsString());
}

// RESOURCE_EXHAUSTED with a RetryInfo delay of `seconds`.
grpc::Status Overloaded(const std::string& message, double seconds) {
  google::rpc::RetryInfo retry;
  const int64_t whole = static_cast<int64_t>(seconds);
  retry.mutable_retry_delay()->set_seconds(whole);
  retry.mutable_retry_delay()->set_nanos(static_cast<int32_t>((seconds - whole) * 1e9));
  return RichStatus(grpc::StatusCode::RESOURCE_EXHAUSTED, message, retry);
}

int ItemSize(int dtype) {
  switch (dtype) {
    case expertd::v1::DTYPE_FLOAT32: return 4;
    case expertd::v1::DTYPE_BFLOAT16:
    case expertd::v1::DTYPE_FLOAT16: return 2;
    default: return 0;
  }
}

// The first row of `data` ([rows, width] of `dtype`) holding a NaN or Inf, or -1: a float is one
// exactly when its exponent bits are all set.
int64_t FirstNonFiniteRow(const char* data, int dtype, int64_t rows, int64_t width) {
  const int64_t n = rows * width;
  if (dtype == expertd::v1::DTYPE_FLOAT32) {
    for (int64_t i = 0; i < n; ++i) {
      uint32_t bits;
      std::memcpy(&bits, data + 4 * i, 4);
      if ((bits & 0x7F800000u) == 0x7F800000u) return i / width;
    }
    return -1;
  }
  const uint16_t mask = dtype == expertd::v1::DTYPE_BFLOAT16 ? 0x7F80 : 0x7C00;
  for (int64_t i = 0; i < n; ++i) {
    uint16_t bits;
    std::memcpy(&bits, data + 2 * i, 2);
    if ((bits & mask) == mask) return i / width;
  }
  return -1;
}

std::string DtypeName(int dtype) {
  switch (dtype) {
    case expertd::v1::DTYPE_FLOAT32: return "float32";
    case expertd::v1::DTYPE_BFLOAT16: return "bfloat16";
    case expertd::v1::DTYPE_FLOAT16: return "float16";
    case expertd::v1::DTYPE_INT32: return "int32";
    default: return "DType(" + std::to_string(dtype) + ")";
  }
}

// "[a, b, c]", at most the first 8 dimensions (a hostile shape cannot grow the message).
std::string ShownShape(const google::protobuf::RepeatedField<int64_t>& shape) {
  std::string text = "[";
  for (int i = 0; i < shape.size() && i < 8; ++i) text += (i ? ", " : "") + std::to_string(shape.Get(i));
  return text + (shape.size() > 8 ? ", ...]" : "]");
}

bool ConstantTimeEqual(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? a[i] : 0, y = i < b.size() ? b[i] : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

std::string Trim(std::string text) {
  const char* blanks = " \t";
  text.erase(0, text.find_first_not_of(blanks));
  text.erase(text.find_last_not_of(blanks) + 1);
  return text;
}

// A call accepted onto the queue. The request is parsed here from the call's bytes (so that a body
// that does not parse gets INVALID_ARGUMENT); the answer is serialized into `response`, gRPC's buffer,
// which lives until the reactor finishes.
struct Call {
  grpc::CallbackServerContext* context;
  grpc::ServerUnaryReactor* reactor;
  std::shared_ptr<const ForwardRequest> request;
  grpc::ByteBuffer* response;
  int64_t rows;
  Clock::time_point arrived;
};

// One batch's key: calls merge only with calls of the same layer, dtype and token-id presence.
struct Key {
  uint32_t layer;
  int dtype;
  bool ids;
  bool operator==(const Key& other) const {
    return layer == other.layer && dtype == other.dtype && ids == other.ids;
  }
};

Key KeyOf(const ForwardRequest& request) {
  return {request.layer(), request.hidden_states().dtype(), request.has_token_ids()};
}

// Forward is registered raw (bytes in, bytes out): gRPC C++ answers a body its own parser rejects
// with UNIMPLEMENTED, so the port parses the bytes itself.
class Front final
    : public expertd::v1::ExpertService::WithRawCallbackMethod_Forward<expertd::v1::ExpertService::CallbackService> {
 public:
  std::unordered_map<uint32_t, int64_t> hidden;  // layer -> H
  std::string layer_list;                        // "0, 1" for messages
  int64_t max_request_tokens = 0, max_batch_tokens = 0, max_queued_tokens = 0, max_queued_calls = 0;
  std::string token;  // empty: no auth
  std::vector<double> latency_bounds;
  std::unique_ptr<grpc::Server> server;
  int ready_fd = -1;  // an eventfd: readable while calls may be queued

  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* context, const grpc::ByteBuffer* body,
                                    grpc::ByteBuffer* response) override {
    const Clock::time_point arrived = Clock::now();
    auto* reactor = context->DefaultReactor();
    auto request = std::make_shared<ForwardRequest>();
    grpc::Status refusal = Parse(context, body, request.get());
    if (refusal.ok()) refusal = Check(*request);
    bool notify = false;
    int64_t direct = 0;
    if (!refusal.ok()) {
      Complete(reactor, refusal, arrived);
      return reactor;
    }
    const int64_t rows = request->hidden_states().shape(0);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!accepting_) {
        refusal = grpc::Status(grpc::StatusCode::UNAVAILABLE, reason_);
      } else if (queued_tokens_ + rows > max_queued_tokens) {
        refusal = Overloaded("overloaded: " + std::to_string(queued_tokens_) + " tokens queued on the native port, "
                             "the limit is " + std::to_string(max_queued_tokens) + "; retry later",
                             RetryDelay(request->layer(), queued_tokens_ + rows - max_queued_tokens));
      } else if (static_cast<int64_t>(queue_.size()) >= max_queued_calls) {
        refusal = Overloaded("overloaded: " + std::to_string(queue_.size()) + " calls queued on the native port, "
                             "the limit is " + std::to_string(max_queued_calls) + "; retry later",
                             RetryDelay(request->layer(), queued_tokens_ / std::max<int64_t>(queue_.size(), 1)));
      } else if (direct_ != nullptr && !direct_running_ && queue_.empty() && in_flight_.empty()) {
        direct = ++last_batch_;  // a lone call on an idle port: its own batch, and this thread the runner
        in_flight_[direct] = {Call{context, reactor, std::move(request), response, rows, arrived}};
        direct_running_ = true;
      } else {
        queued_tokens_ += rows;
        // Python drains the queue after each wake-up: only the first call wakes it, and none while a
        // direct runner is on, which takes the queue itself after its step (RunDirect).
        notify = queue_.empty() && !direct_running_;
        queue_.push_back({context, reactor, std::move(request), response, rows, arrived});
      }
    }
    if (!refusal.ok()) {
      Complete(reactor, refusal, arrived);
      return reactor;
    }
    if (direct != 0) RunDirect(direct);
    if (notify) Wake();
    return reactor;
  }

  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const expertd::v1::GetModelInfoRequest*,
                                         expertd::v1::GetModelInfoResponse* response) override {
    auto* reactor = context->DefaultReactor();
    if (!Authorized(context)) {
      reactor->Finish(Unauthenticated());
      return reactor;
    }
    {
      std::lock_guard<std::mutex> lock(info_mu_);
      *response = model_info_;
    }
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  // False when `serialized` is not a GetModelInfoResponse (the answer stays as it was).
  bool SetModelInfo(const std::string& serialized) {
    expertd::v1::GetModelInfoResponse info;
    if (!info.ParseFromString(serialized)) return false;
    std::lock_guard<std::mutex> lock(info_mu_);
    model_info_.Swap(&info);
    return true;
  }

  // Set before the server starts (no call can race it): why calls are refused until SetAccepting.
  void SetInitialReason(std::string reason) { reason_ = std::move(reason); }

  // Seconds per token of each layer's queued work (layers not given: none) and the least delay.
  void SetRetryHint(std::unordered_map<uint32_t, double> seconds_per_token, double min_s) {
    std::lock_guard<std::mutex> lock(mu_);
    seconds_per_token_ = std::move(seconds_per_token);
    min_retry_s_ = min_s;
  }

  void SetAccepting(bool accepting, std::string reason) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      accepting_ = accepting;
      reason_ = std::move(reason);
    }
    SetHealth(accepting);
  }

  // Health of "", "expertd.v1.ExpertService" and "readiness" (as on the main port); "liveness" is
  // SERVING from the start.
  void SetHealth(bool serving) {
    auto* health = server->GetHealthCheckService();
    for (const char* service : {"", "expertd.v1.ExpertService", "readiness"}) {
      health->SetServingStatus(service, serving);
    }
    health->SetServingStatus("liveness", true);
  }

  // The next batch's id and calls, or none when nothing is queued (or once stopped).
  // With no batch in flight, a first call that arrived after the last batch was answered goes alone:
  // an idle server starts it at once and answers it on its own, as the main port does, so calls that
  // arrive together at an idle port (one client's micro-batches) are not tied to one answer. Calls
  // that queued behind a batch (arriving while it was in flight) merge, as on the main port, even
  // when every batch has been answered by the time they are taken.
  std::pair<int64_t, std::vector<Call>> TryTake() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (stopping_ || queue_.empty()) return {0, {}};
      std::vector<Call> calls = NextBatchLocked(lock);
      if (calls.empty()) continue;
      const int64_t id = ++last_batch_;
      in_flight_[id] = calls;
      return {id, std::move(calls)};
    }
  }

  // The first queued calls that make one batch (TryTake's rule; `behind`: every call queued behind
  // a batch, none goes alone), removed from the queue; none when every call met was cancelled
  // (those are answered CANCELLED, with `lock` on mu_ let go meanwhile).
  std::vector<Call> NextBatchLocked(std::unique_lock<std::mutex>& lock, bool behind = false) {
    bool alone = false;
    std::vector<Call> calls;
    std::vector<Call> dropped;
    int64_t rows = 0;
    Key key{};
    for (auto it = queue_.begin(); it != queue_.end();) {
      if (alone && !calls.empty()) break;
      if (it->context->IsCancelled()) {
        queued_tokens_ -= it->rows;
        dropped.push_back(*it);
        it = queue_.erase(it);
        continue;
      }
      if (calls.empty()) {
        key = KeyOf(*it->request);
        alone = !behind && in_flight_.empty() && it->arrived > last_answered_;
      } else if (!(KeyOf(*it->request) == key) || rows + it->rows > max_batch_tokens) {
        if (rows >= max_batch_tokens) break;
        ++it;
        continue;
      }
      rows += it->rows;
      queued_tokens_ -= it->rows;
      calls.push_back(*it);
      it = queue_.erase(it);
    }
    if (!dropped.empty()) {
      lock.unlock();
      for (const Call& call : dropped) {
        Complete(call.reactor, grpc::Status(grpc::StatusCode::CANCELLED, "cancelled while queued"), call.arrived);
      }
      lock.lock();
    }
    return calls;
  }

  // The calls of batch `id` (removed from the batches in flight), or false if there is none.
  bool Release(int64_t id, std::vector<Call>* calls) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = in_flight_.find(id);
    if (it == in_flight_.end()) return false;
    *calls = std::move(it->second);
    in_flight_.erase(it);
    last_answered_ = Clock::now();
    return true;
  }

  void Complete(grpc::ServerUnaryReactor* reactor, const grpc::Status& status, Clock::time_point arrived) {
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
    reactor->Finish(status);
  }

  PyObject* Stats() {
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
  PyObject* Refusals() {
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

  // Signals `ready_fd` (Python's event loop reads it, then takes every queued batch).
  void Wake() const {
    const uint64_t one = 1;
    ssize_t written;
    do {
      written = write(ready_fd, &one, sizeof(one));
    } while (written < 0 && errno == EINTR);
  }

  // Refuse what is queued, shut the port down (call without the GIL).
  void Stop(double grace_s) {
    std::deque<Call> queued;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      accepting_ = false;
      stopping_ = true;
      direct_ = nullptr;
      reason_ = "the server is shutting down";
      queued.swap(queue_);
      queued_tokens_ = 0;
    }
    for (const Call& call : queued) {
      Complete(call.reactor, grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server is shutting down"),
               call.arrived);
    }
    SetHealth(false);
    server->Shutdown(std::chrono::system_clock::now() +
                     std::chrono::microseconds(static_cast<int64_t>(std::max(grace_s, 0.0) * 1e6)));
  }

  // Lone calls on an idle port from now on run on their gRPC thread through `direct` (None: never).
  // The callable is kept for the process's life, as the front is (a call may be using it).
  void SetDirect(PyObject* direct) {
    if (direct != Py_None) Py_INCREF(direct);
    std::lock_guard<std::mutex> lock(mu_);
    direct_ = direct == Py_None ? nullptr : direct;
  }

  // A lone call that found the port idle (batch `id`, which Forward registered as in flight, this
  // thread the direct runner), run on its gRPC thread. If calls queued meanwhile, the run goes on
  // on the runner thread, not here: a gRPC callback that blocks holds back what it started, the
  // lone call's answer included, until it returns.
  void RunDirect(int64_t id) {
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
  void RunnerThread() {
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
  void RunOne(int64_t id) {
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
  int64_t NextDirect() {
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
  void StopRunner(std::unique_lock<std::mutex>& lock) {
    direct_running_ = false;
    const bool wake = !stopping_ && !queue_.empty();
    lock.unlock();
    if (wake) Wake();
  }

  // take's answer for batch `id` (its `calls`, in flight): (batch, layer, dtype, rows: bytes,
  // token_ids: bytes | None, seconds to the latest caller's deadline | None). Called with the GIL
  // held; nullptr with a Python error (the batch then answered RESOURCE_EXHAUSTED).
  PyObject* BatchArgs(int64_t id, const std::vector<Call>& calls) {
    const ForwardRequest& first = *calls.front().request;
    const int64_t width = hidden.at(first.layer());
    const int itemsize = ItemSize(first.hidden_states().dtype());
    int64_t rows = 0;
    for (const Call& call : calls) rows += call.rows;
    PyObject* rows_bytes = PyBytes_FromStringAndSize(nullptr, rows * width * itemsize);
    PyObject* ids_bytes = Py_None;
    Py_INCREF(Py_None);
    if (first.has_token_ids()) {
      Py_DECREF(Py_None);
      ids_bytes = PyBytes_FromStringAndSize(nullptr, rows * 4);
    }
    if (rows_bytes == nullptr || ids_bytes == nullptr) {
      Py_XDECREF(rows_bytes);
      Py_XDECREF(ids_bytes);
      std::vector<Call> lost;
      if (Release(id, &lost)) {
        for (const Call& call : lost) {
          Complete(call.reactor, grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "out of memory"), call.arrived);
        }
      }
      return nullptr;
    }
    char* to = PyBytes_AS_STRING(rows_bytes);
    char* ids_to = ids_bytes == Py_None ? nullptr : PyBytes_AS_STRING(ids_bytes);
    Py_BEGIN_ALLOW_THREADS
    for (const Call& call : calls) {
      const std::string& data = call.request->hidden_states().data();
      std::memcpy(to, data.data(), data.size());
      to += data.size();
      if (ids_to != nullptr) {
        const std::string& ids = call.request->token_ids().data();
        std::memcpy(ids_to, ids.data(), ids.size());
        ids_to += ids.size();
      }
    }
    Py_END_ALLOW_THREADS
    // The batch is worth computing until its last caller's deadline; None: a caller set none.
    const auto latest = std::max_element(calls.begin(), calls.end(), [](const Call& a, const Call& b) {
                          return a.context->deadline() < b.context->deadline();
                        })->context->deadline();
    PyObject* remaining;
    if (latest == std::chrono::system_clock::time_point::max()) {
      Py_INCREF(Py_None);
      remaining = Py_None;
    } else {
      remaining = PyFloat_FromDouble(std::chrono::duration<double>(latest - std::chrono::system_clock::now()).count());
    }
    return Py_BuildValue("(LIiNNN)", static_cast<long long>(id), first.layer(),
                         first.hidden_states().dtype(), rows_bytes, ids_bytes, remaining);
  }

  void InitStats() { latency_counts_.assign(latency_bounds.size() + 1, 0); }

 private:
  bool Authorized(grpc::CallbackServerContext* context) const {
    if (token.empty()) return true;
    const auto& metadata = context->client_metadata();
    auto it = metadata.find("authorization");
    if (it == metadata.end()) return false;
    const std::string value = Trim(std::string(it->second.data(), it->second.size()));
    const size_t space = value.find(' ');
    if (space == std::string::npos) return false;
    std::string scheme = value.substr(0, space);
    std::transform(scheme.begin(), scheme.end(), scheme.begin(), [](unsigned char c) { return std::tolower(c); });
    const bool scheme_ok = scheme == "bearer";
    return ConstantTimeEqual(Trim(value.substr(space + 1)), token) && scheme_ok;
  }

  static grpc::Status Unauthenticated() {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing or invalid bearer token (metadata 'authorization: Bearer <token>')");
  }

  static grpc::Status Invalid(const std::string& field, const std::string& description) {
    google::rpc::BadRequest bad;
    auto* violation = bad.add_field_violations();
    violation->set_field(field);
    violation->set_description(description);
    return RichStatus(grpc::StatusCode::INVALID_ARGUMENT, field + ": " + description, bad);
  }

  // The RetryInfo delay for a refusal on `layer`: `tokens` of its work at the hint's rate, at least
  // the hint's minimum. Called with mu_ held.
  double RetryDelay(uint32_t layer, int64_t tokens) const {
    const auto rate = seconds_per_token_.find(layer);
    const double seconds = rate == seconds_per_token_.end() ? 0.0 : rate->second * static_cast<double>(tokens);
    return std::max(seconds, min_retry_s_);
  }

  // `body` parsed into `request`, or why not: UNAUTHENTICATED first (an unauthenticated caller
  // learns nothing of the body's validity), then INVALID_ARGUMENT with the main port's message.
  grpc::Status Parse(grpc::CallbackServerContext* context, const grpc::ByteBuffer* body,
                     ForwardRequest* request) const {
    if (!Authorized(context)) return Unauthenticated();
    grpc::ProtoBufferReader reader(const_cast<grpc::ByteBuffer*>(body));
    if (!request->ParseFromZeroCopyStream(&reader)) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "request is not a valid " + ForwardRequest::descriptor()->full_name() + " message");
    }
    return grpc::Status::OK;
  }

  // OK, or why the parsed call is refused (the field and what was expected).
  grpc::Status Check(const ForwardRequest& request) const {
    auto layer = hidden.find(request.layer());
    if (layer == hidden.end()) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "layer " + std::to_string(request.layer()) +
                                                           " is not served; layers: [" + layer_list + "]");
    }
    const int64_t width = layer->second;
    if (request.return_routing()) {
      return Invalid("return_routing", "routing is returned on the main port (--port), not the native port");
    }
    if (request.has_output_shared_memory() || request.hidden_states().has_shared_memory()) {
      return Invalid(request.has_output_shared_memory() ? "output_shared_memory" : "hidden_states.shared_memory",
                     "shared memory is served on the main port (--port), not the native port");
    }
    const auto& states = request.hidden_states();
    const int itemsize = ItemSize(states.dtype());
    if (itemsize == 0) {
      return Invalid("hidden_states.dtype", "expected one of float32, bfloat16, float16, got " +
                                                DtypeName(states.dtype()));
    }
    const std::string expected = "[T, H=" + std::to_string(width) + "]";
    if (states.shape_size() != 2) {
      return Invalid("hidden_states.shape", "expected 2 dimensions " + expected + ", got " +
                                                std::to_string(states.shape_size()) + ": " +
                                                ShownShape(states.shape()));
    }
    if (states.shape(1) != width) {
      return Invalid("hidden_states.shape", "expected " + expected + ", got " + ShownShape(states.shape()));
    }
    const int64_t rows = states.shape(0);
    if (rows < 1 || rows > max_request_tokens) {
      return Invalid("hidden_states.shape", "expected 1 <= T <= " + std::to_string(max_request_tokens) +
                                                " tokens (--max-request-tokens), got T=" + std::to_string(rows));
    }
    if (static_cast<int64_t>(states.data().size()) != rows * width * itemsize) {
      return Invalid("hidden_states.data", "expected " + std::to_string(rows * width * itemsize) + " bytes for " +
                                               DtypeName(states.dtype()) + " shape " + ShownShape(states.shape()) +
                                               ", got " + std::to_string(states.data().size()));
    }
    if (request.has_token_ids()) {
      const auto& ids = request.token_ids();
      if (ids.dtype() != expertd::v1::DTYPE_INT32) {
        return Invalid("token_ids.dtype", "expected int32 token ids, got " + DtypeName(ids.dtype()));
      }
      if (ids.has_shared_memory()) {
        return Invalid("token_ids.shared_memory", "shared memory is served on the main port (--port)");
      }
      if (ids.shape_size() != 1 || ids.shape(0) != rows) {
        return Invalid("token_ids.shape", "expected [T=" + std::to_string(rows) + "] (one id per token), got " +
                                              ShownShape(ids.shape()));
      }
      if (static_cast<int64_t>(ids.data().size()) != rows * 4) {
        return Invalid("token_ids.data", "expected " + std::to_string(rows * 4) + " bytes for int32 shape [" +
                                             std::to_string(rows) + "], got " + std::to_string(ids.data().size()));
      }
      for (int64_t i = 0; i < rows; ++i) {
        int32_t id;
        std::memcpy(&id, ids.data().data() + 4 * i, 4);
        if (id < 0) return Invalid("token_ids", "expected ids >= 0, got " + std::to_string(id) + " at token " +
                                                    std::to_string(i));
      }
    }
    const int64_t bad = FirstNonFiniteRow(states.data().data(), states.dtype(), rows, width);
    if (bad >= 0) return Invalid("hidden_states", "contains NaN or Inf (first at token " + std::to_string(bad) + ")");
    return grpc::Status::OK;
  }

  std::mutex mu_;
  std::deque<Call> queue_;
  int64_t queued_tokens_ = 0;
  bool accepting_ = false;
  bool stopping_ = false;
  std::string reason_;
  std::unordered_map<uint32_t, double> seconds_per_token_;
  double min_retry_s_ = 0.0;
  int64_t last_batch_ = 0;
  std::map<int64_t, std::vector<Call>> in_flight_;
  Clock::time_point last_answered_{};  // when the latest batch left in_flight_ (answered or failed)
  PyObject* direct_ = nullptr;         // SetDirect's callable (a reference held forever), or none
  bool direct_running_ = false;        // the direct runner is on (queued calls wait for it)
  bool runner_started_ = false;        // the runner thread exists
  bool runner_wanted_ = false;         // RunDirect woke the runner thread
  std::condition_variable runner_cv_;

  std::mutex info_mu_;
  expertd::v1::GetModelInfoResponse model_info_;

  std::mutex stats_mu_;
  std::array<int64_t, kNumCodes> handled_{};
  std::vector<int64_t> latency_counts_;
  double latency_sum_ = 0.0;
  std::map<int, std::pair<int64_t, std::string>> refused_;  // code -> (calls, latest message), since Refusals
};

// Fronts are never destroyed: gRPC's threads may still hold their calls when the interpreter exits.
std::mutex g_fronts_mu;
std::vector<Front*> g_fronts;

Front* Lookup(long long handle) {
  std::lock_guard<std::mutex> lock(g_fronts_mu);
  if (handle < 0 || handle >= static_cast<long long>(g_fronts.size())) {
    PyErr_Format(PyExc_ValueError, "no native front with handle %lld", handle);
    return nullptr;
  }
  return g_fronts[handle];
}

bool BytesOf(PyObject* object, std::string* out, const char* what) {
  char* data;
  Py_ssize_t size;
  if (PyBytes_AsStringAndSize(object, &data, &size) < 0) {
    PyErr_Format(PyExc_TypeError, "%s: expected bytes", what);
    return false;
  }
  out->assign(data, size);
  return true;
}

PyObject* Start(PyObject*, PyObject* args) {
  const char *address, *not_ready;
  PyObject *layers, *model_info, *token, *tls, *bounds;
  long long max_request_tokens, max_batch_tokens, max_queued_tokens, max_queued_calls, max_message_bytes;
  if (!PyArg_ParseTuple(args, "sO!LLLLLSOOOs", &address, &PyDict_Type, &layers, &max_request_tokens,
                        &max_batch_tokens, &max_queued_tokens, &max_queued_calls, &max_message_bytes, &model_info,
                        &token, &tls, &bounds, &not_ready)) {
    return nullptr;
  }
  auto front = std::make_unique<Front>();
  PyObject *key, *value;
  Py_ssize_t position = 0;
  std::vector<long> layer_ids;
  while (PyDict_Next(layers, &position, &key, &value)) {
    const long layer = PyLong_AsLong(key);
    const long long width = PyLong_AsLongLong(value);
    if (PyErr_Occurred()) return nullptr;
    front->hidden[static_cast<uint32_t>(layer)] = width;
    layer_ids.push_back(layer);
  }
  std::sort(layer_ids.begin(), layer_ids.end());
  for (size_t i = 0; i < layer_ids.size(); ++i) {
    front->layer_list += (i ? ", " : "") + std::to_string(layer_ids[i]);
  }
  front->max_request_tokens = max_request_tokens;
  front->max_batch_tokens = std::max<long long>(max_batch_tokens, 1);
  front->max_queued_tokens = max_queued_tokens;
  front->max_queued_calls = max_queued_calls;
  std::string info;
  if (!BytesOf(model_info, &info, "model_info")) return nullptr;
  if (!front->SetModelInfo(info)) {
    PyErr_SetString(PyExc_ValueError, "model_info: not a serialized GetModelInfoResponse");
    return nullptr;
  }
  if (token != Py_None && !BytesOf(token, &front->token, "token")) return nullptr;
  PyObject* bound_list = PySequence_Fast(bounds, "latency_bounds: expected a sequence of floats");
  if (bound_list == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(bound_list); ++i) {
    front->latency_bounds.push_back(PyFloat_AsDouble(PySequence_Fast_GET_ITEM(bound_list, i)));
  }
  Py_DECREF(bound_list);
  if (PyErr_Occurred()) return nullptr;
  front->InitStats();
  front->SetInitialReason(not_ready);
  front->ready_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (front->ready_fd < 0) return PyErr_SetFromErrno(PyExc_OSError);

  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (tls != Py_None) {
    PyObject *key_pem, *chain_pem, *client_ca;
    if (!PyArg_ParseTuple(tls, "SSO", &key_pem, &chain_pem, &client_ca)) return nullptr;
    grpc::SslServerCredentialsOptions options(
        client_ca == Py_None ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                             : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
    if (!BytesOf(key_pem, &pair.private_key, "tls key") || !BytesOf(chain_pem, &pair.cert_chain, "tls chain")) {
      return nullptr;
    }
    options.pem_key_cert_pairs.push_back(pair);
    if (client_ca != Py_None && !BytesOf(client_ca, &options.pem_root_certs, "tls client CA")) return nullptr;
    credentials = grpc::SslServerCredentials(options);
  }

  // A hostile body (a string field that is not UTF-8, say) makes libprotobuf log a line per call;
  // such calls are refused all the same, and callers must not be able to flood the server's log.
  google::protobuf::SetLogHandler(nullptr);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(address, credentials, &port);
  builder.RegisterService(front.get());
  builder.SetMaxReceiveMessageSize(static_cast<int>(std::min<long long>(max_message_bytes, INT32_MAX)));
  builder.SetMaxSendMessageSize(static_cast<int>(std::min<long long>(max_message_bytes, INT32_MAX)));
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  Py_BEGIN_ALLOW_THREADS
  front->server = builder.BuildAndStart();
  Py_END_ALLOW_THREADS
  if (!front->server || port == 0) {
    close(front->ready_fd);
    PyErr_Format(PyExc_OSError, "could not listen on %s (the address is in use or not on this host)", address);
    return nullptr;
  }
  front->SetHealth(false);
  std::lock_guard<std::mutex> lock(g_fronts_mu);
  g_fronts.push_back(front.release());
  return Py_BuildValue("(nii)", static_cast<Py_ssize_t>(g_fronts.size() - 1), port, g_fronts.back()->ready_fd);
}

PyObject* SetAccepting(PyObject*, PyObject* args) {
  long long handle;
  int accepting;
  const char* reason;
  if (!PyArg_ParseTuple(args, "Lps", &handle, &accepting, &reason)) return nullptr;
  Front* front = Lookup(handle);
  if (front == nullptr) return nullptr;
  std::string why(reason);
  Py_BEGIN_ALLOW_THREADS
  front->SetAccepting(accepting != 0, std::move(why));
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyObject* SetModelInfo(PyObject*, PyObject* args) {
  long long handle;
  PyObject* model_info;
  if (!PyArg_ParseTuple(args, "LS", &handle, &model_info)) return nullptr;
  Front* front = Lookup(handle);
  std::string info;
  if (front == nullptr || !BytesOf(model_info, &info, "model_info")) return nullptr;
  if (!front->SetModelInfo(info)) {
    PyErr_SetString(PyExc_ValueError, "model_info: not a serialized GetModelInfoResponse");
    return nullptr;
  }
  Py_RETURN_NONE;
}

// The front named by a call whose only argument is its handle (nullptr with a Python error).
Front* OnlyHandle(PyObject* args) {
  long long handle;
  return PyArg_ParseTuple(args, "L", &handle) ? Lookup(handle) : nullptr;
}

PyObject* Take(PyObject*, PyObject* args) {
  Front* front = OnlyHandle(args);
  if (front == nullptr) return nullptr;
  std::pair<int64_t, std::vector<Call>> batch = front->TryTake();
  if (batch.second.empty()) Py_RETURN_NONE;
  return front->BatchArgs(batch.first, batch.second);
}

PyObject* Finish(PyObject*, PyObject* args) {
  long long handle, id;
  Py_buffer output;
  if (!PyArg_ParseTuple(args, "LLy*", &handle, &id, &output)) return nullptr;
  Front* front = Lookup(handle);
  std::vector<Call> calls;
  if (front == nullptr || !front->Release(id, &calls)) {
    PyBuffer_Release(&output);
    if (front != nullptr) PyErr_Format(PyExc_ValueError, "batch %lld is not in flight", id);
    return nullptr;
  }
  const ForwardRequest& first = *calls.front().request;
  const int64_t width = front->hidden.at(first.layer());
  const int dtype = first.hidden_states().dtype();
  const int64_t itemsize = ItemSize(dtype);
  int64_t rows = 0;
  for (const Call& call : calls) rows += call.rows;
  if (output.len != rows * width * itemsize) {
    for (const Call& call : calls) {
      front->Complete(call.reactor, grpc::Status(grpc::StatusCode::INTERNAL, "internal error (output size)"),
                      call.arrived);
    }
    PyErr_Format(PyExc_ValueError, "output: expected %lld bytes ([%lld, %lld] of %lld-byte items), got %zd",
                 static_cast<long long>(rows * width * itemsize), static_cast<long long>(rows),
                 static_cast<long long>(width), static_cast<long long>(itemsize), output.len);
    PyBuffer_Release(&output);
    return nullptr;
  }
  const char* from = static_cast<const char*>(output.buf);
  Py_BEGIN_ALLOW_THREADS
  for (const Call& call : calls) {
    ForwardResponse answer;
    auto* tensor = answer.mutable_output();
    tensor->set_dtype(static_cast<expertd::v1::DType>(dtype));
    tensor->add_shape(call.rows);
    tensor->add_shape(width);
    const size_t bytes = call.rows * width * itemsize;
    tensor->set_data(from, bytes);
    from += bytes;
    answer.set_request_id(call.request->request_id());
    bool own_buffer;
    const grpc::Status serialized = grpc::SerializationTraits<ForwardResponse>::Serialize(answer, call.response,
                                                                                         &own_buffer);
    front->Complete(call.reactor, serialized, call.arrived);
  }
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&output);
  Py_RETURN_NONE;
}

PyObject* Fail(PyObject*, PyObject* args) {
  long long handle, id;
  int code;
  const char* message;
  PyObject* details;
  if (!PyArg_ParseTuple(args, "LLisS", &handle, &id, &code, &message, &details)) return nullptr;
  Front* front = Lookup(handle);
  std::vector<Call> calls;
  if (front == nullptr || !front->Release(id, &calls)) {
    if (front != nullptr) PyErr_Format(PyExc_ValueError, "batch %lld is not in flight", id);
    return nullptr;
  }
  std::string packed;
  BytesOf(details, &packed, "details");
  const grpc::Status status(static_cast<grpc::StatusCode>(code), message, packed);
  Py_BEGIN_ALLOW_THREADS
  for (const Call& call : calls) front->Complete(call.reactor, status, call.arrived);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyObject* SetDirect(PyObject*, PyObject* args) {
  long long handle;
  PyObject* direct;
  if (!PyArg_ParseTuple(args, "LO", &handle, &direct)) return nullptr;
  Front* front = Lookup(handle);
  if (front == nullptr) return nullptr;
  if (direct != Py_None && !PyCallable_Check(direct)) {
    PyErr_SetString(PyExc_TypeError, "direct: expected a callable or None");
    return nullptr;
  }
  front->SetDirect(direct);
  Py_RETURN_NONE;
}

PyObject* SetRetryHint(PyObject*, PyObject* args) {
  long long handle;
  PyObject* rates;
  double min_s;
  if (!PyArg_ParseTuple(args, "LO!d", &handle, &PyDict_Type, &rates, &min_s)) return nullptr;
  Front* front = Lookup(handle);
  if (front == nullptr) return nullptr;
  std::unordered_map<uint32_t, double> seconds_per_token;
  PyObject *key, *value;
  Py_ssize_t position = 0;
  while (PyDict_Next(rates, &position, &key, &value)) {
    const long layer = PyLong_AsLong(key);
    const double seconds = PyFloat_AsDouble(value);
    if (PyErr_Occurred()) return nullptr;
    seconds_per_token[static_cast<uint32_t>(layer)] = seconds;
  }
  front->SetRetryHint(std::move(seconds_per_token), min_s);
  Py_RETURN_NONE;
}

PyObject* Stats(PyObject*, PyObject* args) {
  Front* front = OnlyHandle(args);
  return front == nullptr ? nullptr : front->Stats();
}

PyObject* Refusals(PyObject*, PyObject* args) {
  Front* front = OnlyHandle(args);
  return front == nullptr ? nullptr : front->Refusals();
}

PyObject* Stop(PyObject*, PyObject* args) {
  long long handle;
  double grace_s;
  if (!PyArg_ParseTuple(args, "Ld", &handle, &grace_s)) return nullptr;
  Front* front = Lookup(handle);
  if (front == nullptr) return nullptr;
  Py_BEGIN_ALLOW_THREADS
  front->Stop(grace_s);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"start", Start, METH_VARARGS, "start(address, layers, max_request_tokens, max_batch_tokens, max_queued_tokens, "
                                   "max_queued_calls, max_message_bytes, model_info, token, tls, latency_bounds, "
                                   "not_ready) -> (handle, port, ready_fd)"},
    {"set_accepting", SetAccepting, METH_VARARGS, "set_accepting(handle, accepting, reason)"},
    {"set_model_info", SetModelInfo, METH_VARARGS, "set_model_info(handle, model_info)"},
    {"set_retry_hint", SetRetryHint, METH_VARARGS, "set_retry_hint(handle, seconds_per_token, min_s)"},
    {"set_direct", SetDirect, METH_VARARGS, "set_direct(handle, direct)"},
    {"take", Take, METH_VARARGS, "take(handle) -> (batch, layer, dtype, rows, token_ids, remaining_s) | None"},
    {"finish", Finish, METH_VARARGS, "finish(handle, batch, output)"},
    {"fail", Fail, METH_VARARGS, "fail(handle, batch, code, message, details)"},
    {"stats", Stats, METH_VARARGS, "stats(handle) -> dict"},
    {"refusals", Refusals, METH_VARARGS, "refusals(handle) -> {code: (calls, last message)}"},
    {"stop", Stop, METH_VARARGS, "stop(handle, grace_s)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "expertd_native_front", nullptr, -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit_expertd_native_front() { return PyModule_Create(&kModule); }
