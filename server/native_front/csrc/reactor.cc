// A call's headers, before its body: gRPC C++ hands the port every call but health's through its
// generic callback API (Front::CreateReactor), with the method and the metadata and no message yet.
// A call to a method the port does not serve is UNIMPLEMENTED and one without the bearer token
// (when one is set) UNAUTHENTICATED, answered at once: no byte of its body is read, so a caller
// without the token cannot make the port hold more than the HTTP/2 stream window it was granted.
// Otherwise the reactor reads the one request message and hands it to Front::Forward or
// Front::GetModelInfo (service.cc), which answer through Answer (Forward's through Complete, which
// counts it); a call still being read when the port stops is answered UNAVAILABLE by Stop, as the
// queued ones are (gRPC would cancel it). A reactor deletes itself when gRPC is done with its call
// (OnDone), never before its one Answer.
#include "front.h"

#include <utility>

namespace expertd::native_front {

namespace {

constexpr char kForwardMethod[] = "/expertd.v1.ExpertService/Forward";
constexpr char kModelInfoMethod[] = "/expertd.v1.ExpertService/GetModelInfo";

}  // namespace

grpc::ServerGenericBidiReactor* Front::CreateReactor(grpc::GenericCallbackServerContext* context) {
  const std::string& method = context->method();
  if (method == kForwardMethod) return new CallReactor(this, context, CallReactor::Method::kForward);
  if (method == kModelInfoMethod) return new CallReactor(this, context, CallReactor::Method::kGetModelInfo);
  return new CallReactor(this, context, CallReactor::Method::kOther);
}

// Reactions started here wait until gRPC binds the reactor to its call (its backlog), then run.
CallReactor::CallReactor(Front* front, grpc::GenericCallbackServerContext* call, Method which)
    : context(call), method(which), front_(front) {
  if (method == Method::kOther) {
    Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "the native port serves Forward and GetModelInfo only"));
    return;
  }
  if (!front_->Authorized(context)) {
    if (method == Method::kForward) {
      front_->Complete(this, front_->Unauthenticated(), arrived);
    } else {
      Answer(front_->Unauthenticated());
    }
    return;
  }
  if (!front_->StartReading(this)) return;
  StartRead(&request_);
}

// While the port runs, a call whose body is being read is in reading_; false (and the call
// answered UNAVAILABLE) once Stop began, which would otherwise leave gRPC to cancel it.
bool Front::StartReading(CallReactor* reactor) {
  std::string reason;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) {
      reading_.insert(reactor);
      return true;
    }
    reason = reason_;
  }
  const grpc::Status refusal(grpc::StatusCode::UNAVAILABLE, reason);
  if (reactor->method == CallReactor::Method::kForward) {
    Complete(reactor, refusal, reactor->arrived);
  } else {
    reactor->Answer(refusal);
  }
  return false;
}

// False when Stop took the call out of reading_ (it answers it): the reader must not.
bool Front::DoneReading(CallReactor* reactor) {
  std::lock_guard<std::mutex> lock(mu_);
  return reading_.erase(reactor) == 1;
}

void CallReactor::Answer(const grpc::Status& status) {
  if (status.ok()) {
    StartWriteAndFinish(&response, grpc::WriteOptions(), status);
  } else {
    Finish(status);
  }
}

// `ok` false: no message came (the caller went away or ended its stream without one, or gRPC
// refused one over the port's message limit, in which case the caller already has gRPC's
// RESOURCE_EXHAUSTED).
void CallReactor::OnReadDone(bool ok) {
  if (!front_->DoneReading(this)) return;
  if (!ok) {
    const grpc::Status status = context->IsCancelled()
                                    ? grpc::Status(grpc::StatusCode::CANCELLED, "the call ended before its request came")
                                    : front_->Undecodable();
    if (method == Method::kForward) {
      front_->Complete(this, status, arrived);
    } else {
      Answer(status);
    }
    return;
  }
  // The body leaves the reactor first: the call may be answered, and the reactor gone, before the
  // handler returns (the direct runner answers on this thread).
  grpc::ByteBuffer body;
  body.Swap(&request_);
  if (method == Method::kForward) {
    front_->Forward(this, &body);
  } else {
    front_->GetModelInfo(this, &body);
  }
}

void CallReactor::OnDone() { delete this; }

}  // namespace expertd::native_front
