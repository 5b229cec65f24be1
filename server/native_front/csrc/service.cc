// The native port's gRPC service, its calls once their body is read (their method and token were
// checked before: reactor.cc): Forward (its parse checked, then refused, queued, or run at once by
// the direct runner on an idle port; its content is checked by Python when taken) and GetModelInfo,
// on gRPC's callback threads (only the direct runner takes the GIL, runner.cc); and the port's state that Python sets (accepting and why not,
// the model description, the retry hint, health) and its shutdown, called from module.cc
// (SetAccepting and Stop with the GIL let go).
#include "front.h"

#include <algorithm>

#include <grpcpp/health_check_service_interface.h>

namespace expertd::native_front {

void Front::Forward(CallReactor* reactor, const grpc::ByteBuffer* body) {
  const Clock::time_point arrived = reactor->arrived;
  grpc::CallbackServerContext* context = reactor->context;
  grpc::ByteBuffer* response = &reactor->response;
  auto request = std::make_shared<ForwardRequest>();
  grpc::Status refusal = Parse(body, request.get());
  bool notify = false;
  int64_t direct = 0;
  if (!refusal.ok()) {
    Complete(reactor, refusal, arrived);
    return;
  }
  const int64_t rows = QueuedRows(*request);  // its content is Python's to check, once taken
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
    return;
  }
  if (direct != 0) RunDirect(direct);
  if (notify) Wake();
}

// The model description Python last gave. The request has no fields: its body is not looked at.
void Front::GetModelInfo(CallReactor* reactor, const grpc::ByteBuffer*) {
  std::string serialized;
  {
    std::lock_guard<std::mutex> lock(info_mu_);
    serialized = model_info_.SerializeAsString();
  }
  grpc::Slice slice(serialized);
  reactor->response = grpc::ByteBuffer(&slice, 1);
  reactor->Answer(grpc::Status::OK);
}

// False when `serialized` is not a GetModelInfoResponse (the answer stays as it was).
bool Front::SetModelInfo(const std::string& serialized) {
  expertd::v1::GetModelInfoResponse info;
  if (!info.ParseFromString(serialized)) return false;
  std::lock_guard<std::mutex> lock(info_mu_);
  model_info_.Swap(&info);
  return true;
}

// Set before the server starts (no call can race it): why calls are refused until SetAccepting.
void Front::SetInitialReason(std::string reason) { reason_ = std::move(reason); }

// Seconds per token of each layer's queued work (layers not given: none) and the least delay.
void Front::SetRetryHint(std::unordered_map<uint32_t, double> seconds_per_token, double min_s) {
  std::lock_guard<std::mutex> lock(mu_);
  seconds_per_token_ = std::move(seconds_per_token);
  min_retry_s_ = min_s;
}

void Front::SetAccepting(bool accepting, std::string reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    accepting_ = accepting;
    reason_ = std::move(reason);
  }
  SetHealth(accepting);
}

// Health of "", "expertd.v1.ExpertService" and "readiness" (as on the main port); "liveness" is
// SERVING from the start.
void Front::SetHealth(bool serving) {
  auto* health = server->GetHealthCheckService();
  for (const char* service : {"", "expertd.v1.ExpertService", "readiness"}) {
    health->SetServingStatus(service, serving);
  }
  health->SetServingStatus("liveness", true);
}

// Refuse what is queued or still being read, shut the port down (call without the GIL).
void Front::Stop(double grace_s) {
  std::deque<Call> queued;
  std::set<CallReactor*> reading;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    accepting_ = false;
    stopping_ = true;
    direct_ = nullptr;
    reason_ = "the server is shutting down";
    queued.swap(queue_);
    reading.swap(reading_);
    queued_tokens_ = 0;
  }
  const grpc::Status refusal(grpc::StatusCode::UNAVAILABLE, "the server is shutting down");
  for (const Call& call : queued) Complete(call.reactor, refusal, call.arrived);
  for (CallReactor* reactor : reading) {
    if (reactor->method == CallReactor::Method::kForward) {
      Complete(reactor, refusal, reactor->arrived);
    } else {
      reactor->Answer(refusal);
    }
  }
  SetHealth(false);
  server->Shutdown(std::chrono::system_clock::now() +
                   std::chrono::microseconds(static_cast<int64_t>(std::max(grace_s, 0.0) * 1e6)));
}

}  // namespace expertd::native_front
