// The native port's call queue and its batches: which queued calls make the next batch (one key:
// layer, dtype, token ids or none; up to max_batch_tokens rows; a lone call at an idle port alone),
// the batches in flight until finish or fail releases them (or fail_call each of their calls),
// take's tuple of a batch (each call's message as bytes, the latest caller's deadline), the tokens a
// call counts for, and the eventfd that wakes Python's event loop. TryTake, NextBatchLocked, Release
// and ReleaseCall hold mu_ (NextBatchLocked lets it go while it answers
// the cancelled calls it met); BatchArgs is called with the GIL held, Wake with neither.
#include "front.h"

#include <algorithm>
#include <cerrno>

#include <unistd.h>

namespace expertd::native_front {

namespace {

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

}  // namespace

// The next batch's id and calls, or none when nothing is queued (or once stopped).
// With no batch in flight, a first call that arrived after the last batch was answered goes alone:
// an idle server starts it at once and answers it on its own, as the main port does, so calls that
// arrive together at an idle port (one client's micro-batches) are not tied to one answer. Calls
// that queued behind a batch (arriving while it was in flight) merge, as on the main port, even
// when every batch has been answered by the time they are taken.
std::pair<int64_t, std::vector<Call>> Front::TryTake() {
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
std::vector<Call> Front::NextBatchLocked(std::unique_lock<std::mutex>& lock, bool behind) {
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

// The calls of batch `id` not answered yet (the batch removed from the batches in flight), or
// false if there is none.
bool Front::Release(int64_t id, std::vector<Call>* calls) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = in_flight_.find(id);
  if (it == in_flight_.end()) return false;
  calls->clear();
  for (Call& call : it->second) {
    if (!call.answered) calls->push_back(std::move(call));
  }
  in_flight_.erase(it);
  last_answered_ = Clock::now();
  return true;
}

// Call `index` of batch `id` (in arrival order, as `take` gave it), marked answered for its
// caller to answer alone; the batch leaves the batches in flight when it was its last. False if
// there is no such call, or it was answered already.
bool Front::ReleaseCall(int64_t id, size_t index, Call* call) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = in_flight_.find(id);
  if (it == in_flight_.end() || index >= it->second.size() || it->second[index].answered) return false;
  it->second[index].answered = true;
  *call = it->second[index];
  if (std::all_of(it->second.begin(), it->second.end(), [](const Call& c) { return c.answered; })) {
    in_flight_.erase(it);
    last_answered_ = Clock::now();
  }
  return true;
}

// The tokens a call counts for in the queue and its batches: its declared T (hidden_states.shape[0]),
// within [0, max_request_tokens], whatever its content (Python refuses a call outside the limit
// when it is taken).
int64_t Front::QueuedRows(const ForwardRequest& request) const {
  const auto& shape = request.hidden_states().shape();
  return shape.empty() ? 0 : std::clamp<int64_t>(shape.Get(0), 0, max_request_tokens);
}

// take's answer for batch `id` (its `calls`, in flight): (batch, bodies: each call's ForwardRequest
// serialized, in arrival order, seconds to the latest caller's deadline | None). Called with the
// GIL held; nullptr with a Python error (the batch then answered RESOURCE_EXHAUSTED).
PyObject* Front::BatchArgs(int64_t id, const std::vector<Call>& calls) {
  PyObject* bodies = PyTuple_New(static_cast<Py_ssize_t>(calls.size()));
  std::vector<std::pair<char*, size_t>> to;
  for (size_t i = 0; bodies != nullptr && i < calls.size(); ++i) {
    const size_t size = calls[i].request->ByteSizeLong();
    PyObject* body = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(size));
    if (body == nullptr) {
      Py_CLEAR(bodies);
      break;
    }
    PyTuple_SET_ITEM(bodies, static_cast<Py_ssize_t>(i), body);
    to.emplace_back(PyBytes_AS_STRING(body), size);
  }
  if (bodies == nullptr) {
    std::vector<Call> lost;
    if (Release(id, &lost)) {
      for (const Call& call : lost) {
        Complete(call.reactor, grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "out of memory"), call.arrived);
      }
    }
    return nullptr;
  }
  Py_BEGIN_ALLOW_THREADS
  for (size_t i = 0; i < calls.size(); ++i) {
    calls[i].request->SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(to[i].first));
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
  return Py_BuildValue("(LNN)", static_cast<long long>(id), bodies, remaining);
}

// Signals `ready_fd` (Python's event loop reads it, then takes every queued batch).
void Front::Wake() const {
  const uint64_t one = 1;
  ssize_t written;
  do {
    written = write(ready_fd, &one, sizeof(one));
  } while (written < 0 && errno == EINTR);
}

}  // namespace expertd::native_front
