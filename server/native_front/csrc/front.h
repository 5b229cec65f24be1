// expertd's native Forward port: the declarations its sources share (README.md beside this file says
// which source holds what). gRPC C++ serves expertd.v1.ExpertService/Forward (and GetModelInfo, and
// grpc.health.v1), Python once per batch. A Python extension module, `expertd_native_front`
// (module.cc); its one user is expertd/server/native_front/front.py, which says what the port does
// and does not serve.
//
// The port is a transport: it parses and answers, Python's one request path decides. Per call, on
// gRPC's own threads: the method and the bearer token (when one is set; constant-time comparison),
// from the call's headers before its body is read (reactor.cc), then the body (bytes
// that do not parse as a ForwardRequest: INVALID_ARGUMENT), whether the server is accepting (else
// UNAVAILABLE with the reason Python gave), the bounds on queued tokens and calls
// (RESOURCE_EXHAUSTED with a RetryInfo delay: the tokens over the bound, or one queued call's tokens
// for the call bound, at the seconds per token Python last gave; at least its minimum). Nothing
// about the request's content is checked here: a call counts in the queue for its declared tokens
// (hidden_states.shape[0], within [0, max_request_tokens]), and Python decodes and checks each call
// of a batch it takes (expertd/server/frontends/decode.py, the main port's functions), answering a
// call that fails alone (`fail_call`, with the status, message and details Python gives) while the
// others go on. The messages of the token and parse refusals are Python's too, given at start.
// An accepted call joins one FIFO queue; a call that finds the queue empty signals an eventfd. The
// server's event loop watches that fd; woken, it reads it and takes batches (one a loop turn)
// until none is left: calls of one (layer, dtype, with or without token ids), in arrival order, up
// to `max_batch_tokens` rows (a larger call alone; with no batch in flight, a call that arrived
// after the last batch was answered alone), each call's message handed over as its bytes. Where
// Python gave a direct callable (`set_direct`), a call that finds nothing queued or in flight skips
// the queue and the event loop: it becomes a batch of its own at once, and its gRPC thread calls
// `direct` with the GIL held (the arguments `take` would return), which answers it. The direct
// runner is then on: queued calls do not signal the eventfd, and if any queued during that step,
// the front's runner thread takes them as its next batch, and so on while nothing else is in
// flight (RunDirect). Python answers a batch's remaining calls with `finish` (the output rows in
// the callers' dtype, split back per call by their tokens) or `fail` (one status for each). Calls
// cancelled or past their deadline while queued are answered CANCELLED when a take meets them, not
// run.
//
// Every source includes this header first (it brings Python.h, which must come before the standard
// headers). Everything here is in namespace expertd::native_front, hidden: of this code, the module
// exports PyInit_expertd_native_front (module.cc) alone.
#ifndef EXPERTD_NATIVE_FRONT_CSRC_FRONT_H_
#define EXPERTD_NATIVE_FRONT_CSRC_FRONT_H_

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "expertd/v1/expert.grpc.pb.h"

// Hidden from the module's dynamic symbols, as the one-file source's anonymous namespace was: the
// sources share these names, nothing outside the module sees them.
#pragma GCC visibility push(hidden)
namespace expertd::native_front {

using expertd::v1::ForwardRequest;
using expertd::v1::ForwardResponse;
using Clock = std::chrono::steady_clock;

constexpr int kNumCodes = 17;  // grpc::StatusCode values 0..16

// checks.cc: RESOURCE_EXHAUSTED with a RetryInfo delay of `seconds` (a google.rpc.Status detail).
grpc::Status Overloaded(const std::string& message, double seconds);

class Front;

// One call to the port, from its headers to its answer (reactor.cc). gRPC C++ hands the port every
// call but health's through its generic callback API, with the headers only: the method and the
// bearer token are checked there, and a call to another method or without the token is answered at
// once, before a byte of its body is read (the HTTP/2 stream window is all its sender can have
// sent). Only then is the one request message read, and the call goes to Front::Forward or
// Front::GetModelInfo. `Answer` ends it: the response in `response` (OK) or the status alone; the
// reactor deletes itself once gRPC is done with the call.
class CallReactor final : public grpc::ServerGenericBidiReactor {
 public:
  enum class Method { kForward, kGetModelInfo, kOther };  // kOther: UNIMPLEMENTED
  CallReactor(Front* front, grpc::GenericCallbackServerContext* call, Method which);
  void Answer(const grpc::Status& status);  // once per call (Front::Complete, or GetModelInfo)
  void OnReadDone(bool ok) override;
  void OnDone() override;

  grpc::GenericCallbackServerContext* const context;
  grpc::ByteBuffer response;  // written by Answer when the status is OK
  const Clock::time_point arrived = Clock::now();
  const Method method;

 private:
  Front* const front_;
  grpc::ByteBuffer request_;
};

// A call accepted onto the queue. The request is parsed here from the call's bytes (so that a body
// that does not parse gets INVALID_ARGUMENT); the answer is serialized into `response`, its
// reactor's buffer, which lives until the reactor is done. `rows`: the tokens it counts for (QueuedRows); `answered`:
// answered alone (fail_call) while its batch is in flight.
struct Call {
  grpc::CallbackServerContext* context;
  CallReactor* reactor;
  std::shared_ptr<const ForwardRequest> request;
  grpc::ByteBuffer* response;
  int64_t rows;
  Clock::time_point arrived;
  bool answered = false;
};

// One native port: gRPC C++'s generic callback service (every method but health's comes here as
// bytes: the port parses them itself, and decides before reading a body; CallReactor). The public
// fields are set by `start` (module.cc) before the server starts, and only read after; the private
// state is guarded by the mutex its group names. Each method is defined in the file its group names.
class Front final : public grpc::CallbackGenericService {
 public:
  std::unordered_map<uint32_t, int64_t> hidden;  // layer -> H: the answers' shape (Python's model description)
  std::unordered_map<int, int64_t> itemsize;     // expertd.v1.DType -> bytes of one element, the float dtypes
  int64_t max_request_tokens = 0, max_batch_tokens = 0, max_queued_tokens = 0, max_queued_calls = 0;
  std::string token;  // empty: no auth
  std::string unauthenticated_message, undecodable_message;  // Python's (transport/auth.py, interceptors.py)
  std::vector<double> latency_bounds;
  std::unique_ptr<grpc::Server> server;
  int ready_fd = -1;  // an eventfd: readable while calls may be queued

  // reactor.cc: a call's headers checked (method, token) before its body is read; the calls whose
  // body is being read, which Stop answers (false: the port is stopping, answer it now).
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* context) override;
  bool StartReading(CallReactor* reactor);
  bool DoneReading(CallReactor* reactor);

  // service.cc: the calls, once their body is read; the port's state Python sets, and its shutdown.
  void Forward(CallReactor* reactor, const grpc::ByteBuffer* body);
  void GetModelInfo(CallReactor* reactor, const grpc::ByteBuffer* body);
  bool SetModelInfo(const std::string& serialized);
  void SetInitialReason(std::string reason);
  void SetRetryHint(std::unordered_map<uint32_t, double> seconds_per_token, double min_s);
  void SetAccepting(bool accepting, std::string reason);
  void SetHealth(bool serving);
  void Stop(double grace_s);

  // queue.cc: the call queue, its batches and the batches in flight.
  std::pair<int64_t, std::vector<Call>> TryTake();
  std::vector<Call> NextBatchLocked(std::unique_lock<std::mutex>& lock, bool behind = false);
  bool Release(int64_t id, std::vector<Call>* calls);
  bool ReleaseCall(int64_t id, size_t index, Call* call);
  int64_t QueuedRows(const ForwardRequest& request) const;
  PyObject* BatchArgs(int64_t id, const std::vector<Call>& calls);
  void Wake() const;

  // runner.cc: the direct runner (a lone call on its gRPC thread, then the runner thread).
  void SetDirect(PyObject* direct);
  void RunDirect(int64_t id);
  void RunnerThread();
  void RunOne(int64_t id);
  int64_t NextDirect();
  void StopRunner(std::unique_lock<std::mutex>& lock);

  // stats.cc: answering a call, and the port's own counts (per code, latency, refusals).
  void Complete(CallReactor* reactor, const grpc::Status& status, Clock::time_point arrived);
  PyObject* Stats();
  PyObject* Refusals();
  void InitStats();

  // checks.cc: the transport's own checks (token, parse) and its RetryInfo delays.
  bool Authorized(const grpc::CallbackServerContext* context) const;
  grpc::Status Unauthenticated() const;
  grpc::Status Undecodable() const;
  double RetryDelay(uint32_t layer, int64_t tokens) const;
  grpc::Status Parse(const grpc::ByteBuffer* body, ForwardRequest* request) const;

 private:
  // Guarded by mu_: the queue, the batches in flight, whether calls are accepted (and why not), the
  // retry hint and the direct runner.
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
  std::set<CallReactor*> reading_;     // calls whose body is being read (Stop answers them)
  Clock::time_point last_answered_{};  // when the latest batch left in_flight_ (answered or failed)
  PyObject* direct_ = nullptr;         // SetDirect's callable (a reference held forever), or none
  bool direct_running_ = false;        // the direct runner is on (queued calls wait for it)
  bool runner_started_ = false;        // the runner thread exists
  bool runner_wanted_ = false;         // RunDirect woke the runner thread
  std::condition_variable runner_cv_;

  // Guarded by info_mu_: GetModelInfo's answer.
  std::mutex info_mu_;
  expertd::v1::GetModelInfoResponse model_info_;

  // Guarded by stats_mu_: the counts `stats` and `refusals` read.
  std::mutex stats_mu_;
  std::array<int64_t, kNumCodes> handled_{};
  std::vector<int64_t> latency_counts_;
  double latency_sum_ = 0.0;
  std::map<int, std::pair<int64_t, std::string>> refused_;  // code -> (calls, latest message), since Refusals
};

}  // namespace expertd::native_front
#pragma GCC visibility pop

#endif  // EXPERTD_NATIVE_FRONT_CSRC_FRONT_H_
