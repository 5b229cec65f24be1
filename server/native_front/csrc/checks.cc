// The native port's own checks, a transport's: the bearer token, the body's parse, and the
// RESOURCE_EXHAUSTED refusals of its queue bounds (google.rpc.Status with a RetryInfo delay from
// Python's retry hint). Nothing here looks at a request's content (Python decides on that, with the
// main port's functions), and the token and parse refusals carry the messages Python gave at start.
// Called on gRPC's threads, without the GIL; nothing here blocks or takes a lock (RetryDelay's
// caller holds mu_).
#include "front.h"

#include <algorithm>
#include <cctype>

#include <grpcpp/support/proto_buffer_reader.h>

#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"

namespace expertd::native_front {

namespace {

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

}  // namespace

// RESOURCE_EXHAUSTED with a RetryInfo delay of `seconds`, packed into a google.rpc.Status as the
// main port sends its refusals (the client reads the delay from it).
grpc::Status Overloaded(const std::string& message, double seconds) {
  google::rpc::RetryInfo retry;
  const int64_t whole = static_cast<int64_t>(seconds);
  retry.mutable_retry_delay()->set_seconds(whole);
  retry.mutable_retry_delay()->set_nanos(static_cast<int32_t>((seconds - whole) * 1e9));
  google::rpc::Status status;
  status.set_code(static_cast<int32_t>(grpc::StatusCode::RESOURCE_EXHAUSTED));
  status.set_message(message);
  status.add_details()->PackFrom(retry);
  return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, message, status.SerializeAsString());
}

bool Front::Authorized(const grpc::CallbackServerContext* context) const {
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

grpc::Status Front::Unauthenticated() const {
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, unauthenticated_message);
}

// The RetryInfo delay for a refusal on `layer`: `tokens` of its work at the hint's rate, at least
// the hint's minimum. Called with mu_ held.
double Front::RetryDelay(uint32_t layer, int64_t tokens) const {
  const auto rate = seconds_per_token_.find(layer);
  const double seconds = rate == seconds_per_token_.end() ? 0.0 : rate->second * static_cast<double>(tokens);
  return std::max(seconds, min_retry_s_);
}

grpc::Status Front::Undecodable() const {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, undecodable_message);
}

// `body` parsed into `request`, or INVALID_ARGUMENT with Python's message. (The token was checked
// before the body was read: CreateReactor.)
grpc::Status Front::Parse(const grpc::ByteBuffer* body, ForwardRequest* request) const {
  grpc::ProtoBufferReader reader(const_cast<grpc::ByteBuffer*>(body));
  if (!request->ParseFromZeroCopyStream(&reader)) return Undecodable();
  return grpc::Status::OK;
}

}  // namespace expertd::native_front
