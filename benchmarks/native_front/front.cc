// A native gRPC front end for Forward, as a Python extension: the floor of issue 26's thin hop
// without a Python handler (benchmarks/python_floor.py, server kind "native").
//
// gRPC C++'s callback API serves expertd.v1.ExpertService/Forward and grpc.health.v1 (the library's
// default health service). A Forward is checked here (layer 0; hidden_states float32 [T, H] with
// 1 <= T <= max_rows, its byte length, every value finite: else NOT_FOUND / INVALID_ARGUMENT naming
// the field) and queued; one Python thread takes the queued rows as one batch, runs the engine step
// and hands the output back, which answers each call. Other methods are UNIMPLEMENTED.
//
// Python API (one consumer thread calls take / finish in turn):
//   start(address: str, hidden: int, max_rows: int) -> int   the bound port
//   take() -> bytes           float32 [rows, H] of the queued calls (at most max_rows rows), in
//                             arrival order; waits for a call without the GIL
//   finish(output)            a buffer of float32 [rows, H] answering the last take()'s calls
// The server runs until the process ends.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "expertd/v1/expert.grpc.pb.h"

namespace {

using expertd::v1::ForwardRequest;
using expertd::v1::ForwardResponse;

struct Call {
  grpc::ServerUnaryReactor* reactor;
  const ForwardRequest* request;
  ForwardResponse* response;
  int64_t rows;
};

struct Queue {
  int64_t hidden = 0;
  int64_t max_rows = 0;
  std::mutex mu;
  std::condition_variable ready;
  std::deque<Call> calls;
  std::vector<Call> taken;  // the consumer's current batch (its thread only)
};

Queue g_queue;

// The reason `request` cannot be served, or "" (it names the field and what was expected).
std::string Refusal(const ForwardRequest& request, grpc::StatusCode* code) {
  *code = grpc::StatusCode::INVALID_ARGUMENT;
  if (request.layer() != 0) {
    *code = grpc::StatusCode::NOT_FOUND;
    return "layer: " + std::to_string(request.layer()) + " is not served (layers: 0)";
  }
  const auto& states = request.hidden_states();
  if (states.dtype() != expertd::v1::DTYPE_FLOAT32) return "hidden_states.dtype: expected DTYPE_FLOAT32";
  if (states.shape_size() != 2 || states.shape(1) != g_queue.hidden)
    return "hidden_states.shape: expected [T, " + std::to_string(g_queue.hidden) + "]";
  if (states.shape(0) < 1 || states.shape(0) > g_queue.max_rows)
    return "hidden_states.shape: expected 1 <= T <= " + std::to_string(g_queue.max_rows);
  if (static_cast<int64_t>(states.data().size()) != states.shape(0) * g_queue.hidden * 4)
    return "hidden_states.data: expected T * H * 4 bytes";
  const float* values = reinterpret_cast<const float*>(states.data().data());
  for (int64_t i = 0, n = states.shape(0) * g_queue.hidden; i < n; ++i) {
    if (!std::isfinite(values[i])) return "hidden_states: contains NaN or Inf";
  }
  return "";
}

class ExpertService final : public expertd::v1::ExpertService::CallbackService {
 public:
  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* context, const ForwardRequest* request,
                                    ForwardResponse* response) override {
    auto* reactor = context->DefaultReactor();
    grpc::StatusCode code;
    std::string refusal = Refusal(*request, &code);
    if (!refusal.empty()) {
      reactor->Finish(grpc::Status(code, refusal));
      return reactor;
    }
    {
      std::lock_guard<std::mutex> lock(g_queue.mu);
      g_queue.calls.push_back({reactor, request, response, request->hidden_states().shape(0)});
    }
    g_queue.ready.notify_one();
    return reactor;
  }
};

std::unique_ptr<ExpertService> g_service;
std::unique_ptr<grpc::Server> g_server;

PyObject* Start(PyObject*, PyObject* args) {
  const char* address;
  long long hidden, max_rows;
  if (!PyArg_ParseTuple(args, "sLL", &address, &hidden, &max_rows)) return nullptr;
  if (g_server) {
    PyErr_SetString(PyExc_RuntimeError, "the front end is already started");
    return nullptr;
  }
  g_queue.hidden = hidden;
  g_queue.max_rows = max_rows;
  g_service = std::make_unique<ExpertService>();
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(g_service.get());
  g_server = builder.BuildAndStart();
  if (!g_server || port == 0) {
    PyErr_Format(PyExc_OSError, "could not listen on %s", address);
    return nullptr;
  }
  return PyLong_FromLong(port);
}

PyObject* Take(PyObject*, PyObject*) {
  std::vector<Call> batch;
  int64_t rows = 0;
  Py_BEGIN_ALLOW_THREADS
  std::unique_lock<std::mutex> lock(g_queue.mu);
  g_queue.ready.wait(lock, [] { return !g_queue.calls.empty(); });
  while (!g_queue.calls.empty() && rows + g_queue.calls.front().rows <= g_queue.max_rows) {
    rows += g_queue.calls.front().rows;
    batch.push_back(g_queue.calls.front());
    g_queue.calls.pop_front();
  }
  Py_END_ALLOW_THREADS
  PyObject* rows_bytes = PyBytes_FromStringAndSize(nullptr, rows * g_queue.hidden * 4);
  if (rows_bytes == nullptr) return nullptr;
  char* to = PyBytes_AS_STRING(rows_bytes);
  for (const Call& call : batch) {
    const std::string& data = call.request->hidden_states().data();
    std::memcpy(to, data.data(), data.size());
    to += data.size();
  }
  g_queue.taken = std::move(batch);
  return rows_bytes;
}

PyObject* Finish(PyObject*, PyObject* args) {
  Py_buffer output;
  if (!PyArg_ParseTuple(args, "y*", &output)) return nullptr;
  int64_t rows = 0;
  for (const Call& call : g_queue.taken) rows += call.rows;
  if (output.len != rows * g_queue.hidden * 4) {
    PyBuffer_Release(&output);
    PyErr_Format(PyExc_ValueError, "output: expected %lld bytes (float32 [%lld, %lld]), got %zd",
                 static_cast<long long>(rows * g_queue.hidden * 4), static_cast<long long>(rows),
                 static_cast<long long>(g_queue.hidden), output.len);
    return nullptr;
  }
  std::vector<Call> batch = std::move(g_queue.taken);
  g_queue.taken.clear();
  const char* from = static_cast<const char*>(output.buf);
  Py_BEGIN_ALLOW_THREADS
  for (const Call& call : batch) {
    auto* tensor = call.response->mutable_output();
    tensor->set_dtype(expertd::v1::DTYPE_FLOAT32);
    tensor->add_shape(call.rows);
    tensor->add_shape(g_queue.hidden);
    const size_t bytes = call.rows * g_queue.hidden * 4;
    tensor->set_data(from, bytes);
    from += bytes;
    call.response->set_request_id(call.request->request_id());
    call.reactor->Finish(grpc::Status::OK);
  }
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&output);
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"start", Start, METH_VARARGS, "start(address, hidden, max_rows) -> the bound port"},
    {"take", Take, METH_NOARGS, "take() -> float32 [rows, H] bytes of the queued calls"},
    {"finish", Finish, METH_VARARGS, "finish(output): float32 [rows, H] answering the last take()"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "expertd_native_front", nullptr, -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit_expertd_native_front() { return PyModule_Create(&kModule); }
