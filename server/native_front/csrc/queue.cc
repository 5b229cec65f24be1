// The native port's call queue and its batches: which queued calls make the next batch (one key:
// layer, dtype, token ids or none; up to max_batch_tokens rows; a lone call at an idle port alone),
// the batches in flight until finish or fail releases them, take's tuple of a batch (its rows and
// token ids concatenated, the latest caller's deadline), and the eventfd that wakes Python's event
// loop. TryTake, NextBatchLocked and Release hold mu_ (NextBatchLocked lets it go while it answers
// the cancelled calls it met); BatchArgs is called with the GIL held, Wake with neither.
#include "front.h"

#include <algorithm>
#include <cerrno>
#include <cstring>

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

// The calls of batch `id` (removed from the batches in flight), or false if there is none.
bool Front::Release(int64_t id, std::vector<Call>* calls) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = in_flight_.find(id);
  if (it == in_flight_.end()) return false;
  *calls = std::move(it->second);
  in_flight_.erase(it);
  last_answered_ = Clock::now();
  return true;
}

// take's answer for batch `id` (its `calls`, in flight): (batch, layer, dtype, rows: bytes,
// token_ids: bytes | None, seconds to the latest caller's deadline | None). Called with the GIL
// held; nullptr with a Python error (the batch then answered RESOURCE_EXHAUSTED).
PyObject* Front::BatchArgs(int64_t id, const std::vector<Call>& calls) {
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

// Signals `ready_fd` (Python's event loop reads it, then takes every queued batch).
void Front::Wake() const {
  const uint64_t one = 1;
  ssize_t written;
  do {
    written = write(ready_fd, &one, sizeof(one));
  } while (written < 0 && errno == EINTR);
}

}  // namespace expertd::native_front
