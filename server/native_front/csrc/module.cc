// The native port's CPython binding: the module `expertd_native_front` and its functions, each
// parsing its Python arguments, finding the front by its handle and calling it (service.cc, queue.cc,
// runner.cc, stats.cc), the GIL let go around what may block or take long; `start` builds the
// front and its gRPC server from the tables and messages Python gives, `finish` writes each call's
// answer from the batch's output rows.
//
// Python API (every function takes the handle `start` returned; fronts live until the process ends):
//   start(address, layers: dict[int, int] (layer -> H), itemsizes: dict[int, int] (expertd.v1 DType ->
//         bytes, the dtypes answers come in), max_request_tokens, max_batch_tokens, max_queued_tokens,
//         max_queued_calls, max_message_bytes, model_info: bytes (a serialized GetModelInfoResponse),
//         token: bytes | None, tls: (key, chain, client_ca | None) | None, latency_bounds: sequence
//         of float, not_ready: str (why calls are refused until set_accepting), unauthenticated: str,
//         undecodable: str (the messages of those refusals)) -> (handle, port, ready_fd)
//   set_accepting(handle, accepting: bool, reason: str)   also sets health SERVING / NOT_SERVING
//   set_model_info(handle, model_info: bytes)   GetModelInfo's answer from now on (a serialized
//                  GetModelInfoResponse: the main port's, when an expert placement changes)
//   set_retry_hint(handle, seconds_per_token: dict[int, float] (layer -> s), min_s: float)
//                  what a RESOURCE_EXHAUSTED refusal's RetryInfo delay is computed from
//   set_direct(handle, direct: callable | None)   direct(batch, bodies, remaining_s)
//                  for the direct runner's batches (RunDirect), called on a gRPC thread; it must
//                  answer the batch (finish, fail, or later from the event loop); None: every call
//                  is queued
//   take(handle) -> (batch, bodies: tuple of bytes (each call's ForwardRequest, in arrival order: one
//                    layer, dtype and token-ids presence), seconds to the latest caller's deadline
//                    | None) | None
//                  never waits: None when nothing is queued, or once stopped
//   fail_call(handle, batch, index, code: int, message: str, details: bytes)   answers the batch's
//                  call `index` alone (its content refused); the others stay in flight
//   finish(handle, batch, output: buffer)   [rows, H] in the batch's dtype, for its calls not
//                  answered by fail_call (their declared tokens, in order)
//   fail(handle, batch, code: int, message: str, details: bytes)   the same status for each of its
//                  calls not answered yet; details: a google.rpc.Status
//   stats(handle) -> dict   {"handled": {code: n}, "latency": ([counts], sum), "queued_tokens": n,
//                            "queued_calls": n, "batches_in_flight": n}
//   refusals(handle) -> {code: (n, last message: bytes)}   the calls answered with each error code since
//                  the last call, and the latest one's message (for the server's rate-limited log)
//   stop(handle, grace_s)   refuses what is queued (UNAVAILABLE), then shuts the port down,
//                           cancelling calls still unanswered after grace_s
#include "front.h"

#include <algorithm>

#include <google/protobuf/stubs/logging.h>
#include <grpcpp/health_check_service_interface.h>

#include <sys/eventfd.h>
#include <unistd.h>

namespace expertd::native_front {
namespace {

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

// Each key and value of `dict` as C++ integers into `out`; false with a Python error.
template <typename Key>
bool IntTable(PyObject* dict, std::unordered_map<Key, int64_t>* out) {
  PyObject *key, *value;
  Py_ssize_t position = 0;
  while (PyDict_Next(dict, &position, &key, &value)) {
    const long long k = PyLong_AsLongLong(key), v = PyLong_AsLongLong(value);
    if (PyErr_Occurred()) return false;
    (*out)[static_cast<Key>(k)] = v;
  }
  return true;
}

PyObject* Start(PyObject*, PyObject* args) {
  const char *address, *not_ready, *unauthenticated, *undecodable;
  PyObject *layers, *itemsizes, *model_info, *token, *tls, *bounds;
  long long max_request_tokens, max_batch_tokens, max_queued_tokens, max_queued_calls, max_message_bytes;
  if (!PyArg_ParseTuple(args, "sO!O!LLLLLSOOOsss", &address, &PyDict_Type, &layers, &PyDict_Type, &itemsizes,
                        &max_request_tokens, &max_batch_tokens, &max_queued_tokens, &max_queued_calls,
                        &max_message_bytes, &model_info, &token, &tls, &bounds, &not_ready, &unauthenticated,
                        &undecodable)) {
    return nullptr;
  }
  auto front = std::make_unique<Front>();
  if (!IntTable(layers, &front->hidden) || !IntTable(itemsizes, &front->itemsize)) return nullptr;
  front->unauthenticated_message = unauthenticated;
  front->undecodable_message = undecodable;
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
  builder.RegisterCallbackGenericService(front.get());
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
  if (calls.empty()) {  // never: the last call answered alone ends its batch (ReleaseCall)
    PyBuffer_Release(&output);
    Py_RETURN_NONE;
  }
  const ForwardRequest& first = *calls.front().request;
  const auto width_of = front->hidden.find(first.layer());
  const auto itemsize_of = front->itemsize.find(first.hidden_states().dtype());
  const int64_t width = width_of == front->hidden.end() ? 0 : width_of->second;
  const int64_t itemsize = itemsize_of == front->itemsize.end() ? 0 : itemsize_of->second;
  const int dtype = first.hidden_states().dtype();
  int64_t rows = 0;
  for (const Call& call : calls) rows += call.rows;
  if (width == 0 || itemsize == 0 || output.len != rows * width * itemsize) {  // a server bug: Python decided
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

PyObject* FailCall(PyObject*, PyObject* args) {
  long long handle, id;
  Py_ssize_t index;
  int code;
  const char* message;
  PyObject* details;
  if (!PyArg_ParseTuple(args, "LLnisS", &handle, &id, &index, &code, &message, &details)) return nullptr;
  Front* front = Lookup(handle);
  Call call{};
  if (front == nullptr || index < 0 || !front->ReleaseCall(id, static_cast<size_t>(index), &call)) {
    if (front != nullptr) PyErr_Format(PyExc_ValueError, "batch %lld has no call %zd in flight", id, index);
    return nullptr;
  }
  std::string packed;
  BytesOf(details, &packed, "details");
  const grpc::Status status(static_cast<grpc::StatusCode>(code), message, packed);
  Py_BEGIN_ALLOW_THREADS
  front->Complete(call.reactor, status, call.arrived);
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
    {"start", Start, METH_VARARGS, "start(address, layers, itemsizes, max_request_tokens, max_batch_tokens, "
                                   "max_queued_tokens, max_queued_calls, max_message_bytes, model_info, token, tls, "
                                   "latency_bounds, not_ready, unauthenticated, undecodable) -> (handle, port, "
                                   "ready_fd)"},
    {"set_accepting", SetAccepting, METH_VARARGS, "set_accepting(handle, accepting, reason)"},
    {"set_model_info", SetModelInfo, METH_VARARGS, "set_model_info(handle, model_info)"},
    {"set_retry_hint", SetRetryHint, METH_VARARGS, "set_retry_hint(handle, seconds_per_token, min_s)"},
    {"set_direct", SetDirect, METH_VARARGS, "set_direct(handle, direct)"},
    {"take", Take, METH_VARARGS, "take(handle) -> (batch, bodies, remaining_s) | None"},
    {"fail_call", FailCall, METH_VARARGS, "fail_call(handle, batch, index, code, message, details)"},
    {"finish", Finish, METH_VARARGS, "finish(handle, batch, output)"},
    {"fail", Fail, METH_VARARGS, "fail(handle, batch, code, message, details)"},
    {"stats", Stats, METH_VARARGS, "stats(handle) -> dict"},
    {"refusals", Refusals, METH_VARARGS, "refusals(handle) -> {code: (calls, last message)}"},
    {"stop", Stop, METH_VARARGS, "stop(handle, grace_s)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "expertd_native_front", nullptr, -1, kMethods, nullptr, nullptr,
                       nullptr, nullptr};

}  // namespace
}  // namespace expertd::native_front

PyMODINIT_FUNC PyInit_expertd_native_front() { return PyModule_Create(&expertd::native_front::kModule); }
