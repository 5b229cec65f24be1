// The per-call checks of the native port and the refusals they make: the bearer token, the body's
// parse, the request's fields, and how a refusal is built (google.rpc.Status with a BadRequest field
// violation, or a RetryInfo delay from Python's retry hint). The codes and messages are those the
// main port answers (tests/server/test_native_front.py holds the two ports to it): change both
// together. Called on gRPC's threads, without the GIL; nothing here blocks or takes a lock
// (RetryDelay's caller holds mu_).
#include "front.h"

#include <algorithm>
#include <cctype>
#include <cstring>

#include <grpcpp/support/proto_buffer_reader.h>

#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"

namespace expertd::native_front {

namespace {

// `code` and `message` with `detail` packed into a google.rpc.Status, as the main port sends its
// refusals (the client reads field violations and retry delays from it).
grpc::Status RichStatus(grpc::StatusCode code, const std::string& message, const google::protobuf::Message& detail) {
  google::rpc::Status status;
  status.set_code(static_cast<int32_t>(code));
  status.set_message(message);
  status.add_details()->PackFrom(detail);
  return grpc::Status(code, message, status.SerializeAsString());
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

}  // namespace

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

bool Front::Authorized(grpc::CallbackServerContext* context) const {
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

grpc::Status Front::Unauthenticated() {
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      "missing or invalid bearer token (metadata 'authorization: Bearer <token>')");
}

grpc::Status Front::Invalid(const std::string& field, const std::string& description) {
  google::rpc::BadRequest bad;
  auto* violation = bad.add_field_violations();
  violation->set_field(field);
  violation->set_description(description);
  return RichStatus(grpc::StatusCode::INVALID_ARGUMENT, field + ": " + description, bad);
}

// The RetryInfo delay for a refusal on `layer`: `tokens` of its work at the hint's rate, at least
// the hint's minimum. Called with mu_ held.
double Front::RetryDelay(uint32_t layer, int64_t tokens) const {
  const auto rate = seconds_per_token_.find(layer);
  const double seconds = rate == seconds_per_token_.end() ? 0.0 : rate->second * static_cast<double>(tokens);
  return std::max(seconds, min_retry_s_);
}

// `body` parsed into `request`, or why not: UNAUTHENTICATED first (an unauthenticated caller
// learns nothing of the body's validity), then INVALID_ARGUMENT with the main port's message.
grpc::Status Front::Parse(grpc::CallbackServerContext* context, const grpc::ByteBuffer* body,
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
grpc::Status Front::Check(const ForwardRequest& request) const {
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

}  // namespace expertd::native_front
