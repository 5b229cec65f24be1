"""Requests as the batcher takes them: decoded and validated once, at the edge, by one function per
wire format, and cast once to the engine's dtype.

| wire message | decoder | request |
|---|---|---|
| expertd.v1 ForwardRequest (Forward, each ForwardStream message) | ``decode_forward`` | ForwardRequest |
| expertd.v1 RouteRequest | ``decode_route`` | RouteRequest |
| KServe v2 ModelInferRequest | ``decode_model_infer`` | ForwardRequest (+ the outputs asked for) |

Every decoder checks against the read-only ``ModelDescription``: the layer is served
(``UnknownLayerError``: NOT_FOUND), then, naming the field (``InvalidRequest``: INVALID_ARGUMENT),
dtype, shape, byte length, width (H, or E for logits), the token limit 1 <= T <= max_request_tokens
and NaN / Inf (``check_tokens``, shared). Nothing after the decoder checks a request again.

Headers first: ``forward_header``, ``route_header`` and ``model_infer_header`` read only a
request's header fields (layer or model, dtype, the number of dimensions and the shape) and give
the ``Header`` admission decides on, before the tensor body is touched; each decoder checks its
header the same way first. Their cost does not grow with the request: a repeated field is measured
with ``len`` and at most a few of its entries are read, and every value an error message quotes
is bounded (``errors.shown``).

Casts: a token array changes dtype at most twice on its way through the server, both times through
``cast``: here, from the wire dtype to the engine's (no copy when they are equal), and once in the
batcher, from the engine's dtype to the caller's. Shapes: T tokens, H hidden, E routed experts.
"""
from __future__ import annotations

import dataclasses
import sys
import time

import ml_dtypes
import numpy as np

from expertd.client import codec
from expertd.client.pb.v1 import expert_pb2
from expertd.server import steps
from expertd.server.description import ModelDescription
from expertd.server.errors import InvalidRequest, UnknownLayerError, shown, shown_shape


@dataclasses.dataclass(frozen=True)
class Header:
    """What admission needs: the layer, the step kind (``steps.FORWARD``, ``ROUTE_HIDDEN``,
    ``ROUTE_LOGITS``) and the tokens T, read from the header fields alone."""

    layer: int
    kind: str
    tokens: int


@dataclasses.dataclass(frozen=True)
class ForwardRequest:
    """One MoE-layer forward: ``tokens [T, H]`` in the engine dtype, the dtype the caller sent
    (``out_dtype``: its output comes back in it), its deadline (monotonic seconds, or None) and
    the name of its input field (what an error about its tokens names)."""

    layer: int
    tokens: np.ndarray
    out_dtype: np.dtype
    deadline: float | None = None
    field: str = "hidden_states"


@dataclasses.dataclass(frozen=True)
class RouteRequest:
    """Top-k routing of ``tokens``: hidden states ``[T, H]`` in the engine dtype, or router logits
    ``[T, E]`` float32 (``from_logits``); the aux loss is scaled by ``aux_loss_coeff`` (>= 0)."""

    layer: int
    tokens: np.ndarray
    from_logits: bool
    aux_loss_coeff: float
    deadline: float | None = None
    field: str = "hidden_states"


def cast(array: np.ndarray, dtype) -> np.ndarray:
    """``array`` in ``dtype``: the serving path's only change of a token array's dtype (no copy when
    it is already ``dtype``)."""
    return array.astype(dtype, copy=False)


def check_tokens(array: np.ndarray, field: str, width: int, width_name: str, max_tokens: int) -> None:
    """Shape ``[T, width]`` with 1 <= T <= max_tokens and no NaN / Inf (InvalidRequest otherwise)."""
    _check_shape(*array.shape, field, width, width_name, max_tokens)
    finite = np.isfinite(array)
    if not finite.all():
        row = int(np.argwhere(~finite)[0][0])
        raise InvalidRequest(field, f"contains NaN or Inf (first at token {row})")


# ---------------------------------------------------------------------- expertd.v1

def forward_header(message: expert_pb2.ForwardRequest, model: ModelDescription) -> Header:
    """A Forward (or ForwardStream) message's Header, its tensor body untouched."""
    cfg = model.layer(message.layer)
    tensor = message.hidden_states if message.HasField("hidden_states") else None
    tokens = _tensor_header(tensor, "hidden_states", cfg.hidden_size, "H", model.max_request_tokens)
    return Header(message.layer, steps.FORWARD, tokens)


def decode_forward(message: expert_pb2.ForwardRequest, model: ModelDescription,
                   deadline: float | None) -> ForwardRequest:
    """A Forward (or ForwardStream) message as a ForwardRequest."""
    cfg = model.layer(message.layer)
    tensor = message.hidden_states if message.HasField("hidden_states") else None
    wire = _tensor(tensor, "hidden_states", cfg.hidden_size, "H", model.max_request_tokens)
    return ForwardRequest(message.layer, cast(wire, model.dtype), wire.dtype, deadline)


def route_header(message: expert_pb2.RouteRequest, model: ModelDescription) -> Header:
    """A Route message's Header, its tensor body untouched."""
    cfg = model.layer(message.layer)
    which, width, name = _route_input(message, cfg)
    tokens = _tensor_header(getattr(message, which), which, width, name, model.max_request_tokens)
    return Header(message.layer, steps.ROUTE_LOGITS if which == "logits" else steps.ROUTE_HIDDEN, tokens)


def decode_route(message: expert_pb2.RouteRequest, model: ModelDescription, default_aux_loss_coeff: float,
                 deadline: float | None) -> RouteRequest:
    """A Route message as a RouteRequest (the aux-loss coefficient defaults to ``default_aux_loss_coeff``)."""
    cfg = model.layer(message.layer)
    which, width, name = _route_input(message, cfg)
    wire = _tensor(getattr(message, which), which, width, name, model.max_request_tokens)
    coeff = message.aux_loss_coeff if message.HasField("aux_loss_coeff") else default_aux_loss_coeff
    if not (np.isfinite(coeff) and coeff >= 0):
        raise InvalidRequest("aux_loss_coeff", f"must be finite and >= 0, got {coeff}")
    from_logits = which == "logits"
    tokens = cast(wire, np.float32 if from_logits else model.dtype)
    return RouteRequest(message.layer, tokens, from_logits, float(coeff), deadline, which)


def _route_input(message: expert_pb2.RouteRequest, cfg) -> tuple[str, int, str]:
    """(the input field set, its width, the width's name)."""
    which = message.WhichOneof("input")
    if which is None:
        raise InvalidRequest("input", "set hidden_states [T, H] or logits [T, E]")
    return (which, cfg.num_experts, "E") if which == "logits" else (which, cfg.hidden_size, "H")


def _tensor_header(tensor, field: str, width: int, width_name: str, max_tokens: int) -> int:
    """T of ``tensor``, checked from its dtype and shape alone: a float dtype, [T, width], 1 <= T <= max_tokens."""
    if tensor is None:
        raise InvalidRequest(field, f"required: a [T, {width_name}={width}] tensor")
    if tensor.dtype not in codec.FLOAT_DTYPES:
        expected = ", ".join(codec.dtype_name(d) for d in codec.FLOAT_DTYPES)
        raise InvalidRequest(f"{field}.dtype", f"expected one of {expected}, got {codec.dtype_name(tensor.dtype)}")
    return _shape_header(tensor.shape, field, width, width_name, max_tokens)


def _shape_header(shape, field: str, width: int, width_name: str, max_tokens: int) -> int:
    if len(shape) != 2:
        raise InvalidRequest(f"{field}.shape", f"expected 2 dimensions [T, {width_name}={width}], got {len(shape)}: "
                                               f"{shown_shape(shape)}")
    tokens, columns = int(shape[0]), int(shape[1])
    _check_shape(tokens, columns, field, width, width_name, max_tokens)
    return tokens


def _check_shape(tokens: int, columns: int, field: str, width: int, width_name: str, max_tokens: int) -> None:
    if columns != width:
        raise InvalidRequest(f"{field}.shape", f"expected [T, {width_name}={width}], got [{tokens}, {columns}]")
    if not 1 <= tokens <= max_tokens:
        raise InvalidRequest(f"{field}.shape", f"expected 1 <= T <= {max_tokens} tokens (--max-request-tokens), "
                                               f"got T={tokens}")


def _tensor(tensor, field: str, width: int, width_name: str, max_tokens: int) -> np.ndarray:
    """``tensor`` decoded as ``[T, width]`` float32 / bfloat16 / float16 (the wire dtype), checked."""
    _tensor_header(tensor, field, width, width_name, max_tokens)
    try:
        array = codec.decode(tensor, field=field, dtypes=codec.FLOAT_DTYPES, ndim=2)
    except codec.TensorError as exc:
        raise InvalidRequest(exc.field, exc.description) from None
    check_tokens(array, field, width, width_name, max_tokens)
    return array


# ---------------------------------------------------------------------- KServe v2

MODEL_PREFIX = "moe-layer-"
MODEL_VERSION = "1"
INPUT = "hidden_states"
OUTPUT, TOPK_IDS, TOPK_WEIGHTS = "output", "router_topk_ids", "router_topk_weights"
OUTPUTS = (OUTPUT, TOPK_IDS, TOPK_WEIGHTS)
DATATYPES = {"BF16": np.dtype(ml_dtypes.bfloat16), "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32)}


def model_name(layer: int) -> str:
    return f"{MODEL_PREFIX}{layer}"


def layer_of_model(model: ModelDescription, name: str, version: str) -> int:
    """The layer index behind KServe model ``name`` (UnknownLayerError, NOT_FOUND, for unknown models or versions).

    Only the canonical name is a model: ``moe-layer-1``, not ``moe-layer-01`` nor other digits.
    """
    index = name[len(MODEL_PREFIX):] if name.startswith(MODEL_PREFIX) else ""
    if not (index.isascii() and index.isdigit() and model_name(int(index)) == name and int(index) in model.layers):
        models = ", ".join(model_name(i) for i in model.layers)
        raise UnknownLayerError(f"unknown model {shown(name)}; models: {models}")
    if version not in ("", MODEL_VERSION):
        raise UnknownLayerError(f"model {shown(name)} has only version {MODEL_VERSION}, not {shown(version)}")
    return int(index)


def model_infer_header(request, model: ModelDescription, layer: int) -> Header:
    """A ModelInferRequest's Header (for ``layer``, ``layer_of_model`` of its model name), its tensor body untouched."""
    tensor, _ = _infer_tensor(request, model.layer(layer).hidden_size, model.max_request_tokens)
    return Header(layer, steps.FORWARD, int(tensor.shape[0]))


def decode_model_infer(request, model: ModelDescription, layer: int,
                       call_deadline: float | None) -> tuple[ForwardRequest, list[str]]:
    """A ModelInferRequest for ``layer`` (``layer_of_model`` of its model name) as a ForwardRequest,
    and the names of the outputs it asks for.

    Its deadline is the earlier of the call's (``call_deadline``) and the ``timeout`` parameter.
    """
    deadline = infer_deadline(request, call_deadline)
    wire = _infer_input(request, model.layer(layer).hidden_size, model.max_request_tokens)
    forward = ForwardRequest(layer, cast(wire, model.dtype), wire.dtype, deadline, f"inputs[{INPUT!r}]")
    return forward, _requested_outputs(request)


def little_endian(array: np.ndarray) -> np.ndarray:
    """The array with little-endian element bytes (the wire order), whatever the host's order."""
    return array.byteswap() if sys.byteorder == "big" else array


def _check_parameters(parameters, field: str, allowed: tuple[str, ...]) -> None:
    for key in parameters:  # stops at the first unknown key: at most len(allowed) + 1 keys are read
        if key not in allowed:
            accepted = ", ".join(allowed) if allowed else "none"
            hint = " (sequence batching: the MoE layer is stateless)" if key.startswith("sequence_") else \
                " (shared memory is not supported; send tensors in raw contents)" \
                if key.startswith("shared_memory") else ""
            raise InvalidRequest(f"{field}[{shown(key)}]", f"unknown parameter{hint}; accepted: {accepted}")


def _non_negative_int(parameters, key: str) -> int:
    """The integer value of request parameter ``key`` (int64 or uint64, >= 0), 0 when absent."""
    if key not in parameters:
        return 0
    choice = parameters[key].WhichOneof("parameter_choice")
    value = getattr(parameters[key], choice) if choice in ("int64_param", "uint64_param") else -1
    if value < 0:
        raise InvalidRequest(f"parameters[{key!r}]", f"expected a non-negative integer, got {choice}")
    return value


def infer_deadline(request, call_deadline: float | None) -> float | None:
    """The earlier of the call's deadline and the ``timeout`` parameter (microseconds), monotonic."""
    _check_parameters(request.parameters, "parameters", ("timeout", "priority"))
    _non_negative_int(request.parameters, "priority")  # validated, then ignored: one priority level
    timeout_us = _non_negative_int(request.parameters, "timeout")
    deadlines = [d for d in (call_deadline, time.monotonic() + timeout_us / 1e6 if timeout_us else None)
                 if d is not None]
    return min(deadlines) if deadlines else None


def _infer_tensor(request, hidden_size: int, max_tokens: int):
    """The ``hidden_states`` input of a ModelInferRequest and its datatype, checked from the header
    fields alone: one input of that name, a known datatype, shape [T, H], 1 <= T <= max_tokens."""
    if len(request.inputs) != 1 or request.inputs[0].name != INPUT:
        names = [shown(tensor.name) for tensor in request.inputs[:4]] + (["..."] if len(request.inputs) > 4 else [])
        raise InvalidRequest("inputs", f"expected exactly one input {INPUT!r} [T, H={hidden_size}], got "
                                       f"{len(request.inputs)}: [{', '.join(names)}]")
    tensor = request.inputs[0]
    field = f"inputs[{INPUT!r}]"
    _check_parameters(tensor.parameters, f"{field}.parameters", ())
    dtype = DATATYPES.get(tensor.datatype)
    if dtype is None:
        raise InvalidRequest(f"{field}.datatype",
                             f"expected one of {', '.join(DATATYPES)}, got {shown(tensor.datatype)}")
    if len(tensor.shape) != 2:
        raise InvalidRequest(f"{field}.shape", f"expected [T, H={hidden_size}] with T >= 1, got "
                                               f"{shown_shape(tensor.shape)}")
    _check_shape(int(tensor.shape[0]), int(tensor.shape[1]), field, hidden_size, "H", max_tokens)
    return tensor, dtype


def _infer_input(request, hidden_size: int, max_tokens: int) -> np.ndarray:
    """``hidden_states [T, H]`` of a ModelInferRequest in its wire dtype, checked."""
    tensor, dtype = _infer_tensor(request, hidden_size, max_tokens)
    field = f"inputs[{INPUT!r}]"
    shape = [int(d) for d in tensor.shape]
    count = shape[0] * shape[1]
    if request.raw_input_contents:
        if tensor.HasField("contents"):
            raise InvalidRequest(f"{field}.contents", "set either raw_input_contents or contents, not both")
        if len(request.raw_input_contents) != 1:
            raise InvalidRequest("raw_input_contents",
                                 f"expected 1 entry (one per input), got {len(request.raw_input_contents)}")
        raw = request.raw_input_contents[0]
        if len(raw) != count * dtype.itemsize:
            raise InvalidRequest("raw_input_contents[0]", f"expected {count * dtype.itemsize} bytes for "
                                                          f"{tensor.datatype} {shape}, got {len(raw)}")
        array = little_endian(np.frombuffer(raw, dtype=dtype).reshape(shape))
    else:
        if tensor.datatype != "FP32":
            raise InvalidRequest(f"{field}.contents",
                                 f"{tensor.datatype} has no typed contents field: send it in raw_input_contents")
        values = tensor.contents.fp32_contents
        if len(values) != count:
            raise InvalidRequest(f"{field}.contents.fp32_contents",
                                 f"expected {count} values for shape {shape}, got {len(values)}")
        array = np.asarray(values, dtype=np.float32).reshape(shape)
    check_tokens(array, field, hidden_size, "H", max_tokens)
    return array


def _requested_outputs(request) -> list[str]:
    if not request.outputs:
        return list(OUTPUTS)
    names = []
    for index, output in enumerate(request.outputs):  # stops at the first bad one: at most 4 are read
        if output.name not in OUTPUTS:
            raise InvalidRequest(f"outputs[{index}].name",
                                 f"expected one of {', '.join(OUTPUTS)}, got {shown(output.name)}")
        if output.name in names:
            raise InvalidRequest(f"outputs[{index}].name", f"{output.name!r} requested twice")
        _check_parameters(output.parameters, f"outputs[{output.name!r}].parameters", ())
        names.append(output.name)
    return names
