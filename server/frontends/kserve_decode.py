"""KServe v2 ModelInferRequests as the batcher takes them: decoded and validated once
(``decode_model_infer``), with the shared-memory slots their outputs go to.

Models are ``moe-layer-<index>``, version ``1`` (``layer_of_model``). Inputs, by name:

| input | datatype | shape | |
|---|---|---|---|
| ``hidden_states`` | BF16, FP16 or FP32 | [T, H] | required |
| ``token_ids`` | INT32 | [T] | optional: the tokens' vocabulary ids (hash-routed layers) |

Each input's bytes come from exactly one place: ``raw_input_contents`` (one entry per input that
uses neither shared memory nor typed contents, in ``inputs`` order), typed ``contents``
(``fp32_contents`` for FP32, ``int_contents`` for INT32; BF16 / FP16 have no typed field), or a
registered system shared-memory region named by the parameters ``shared_memory_region``,
``shared_memory_offset`` (default 0) and ``shared_memory_byte_size`` (``expertd.server.frontends.shared_memory``).
Outputs (none requested: all three) may name a region the same way; they are then written there and
left out of ``raw_output_contents``. Checks, naming the field (INVALID_ARGUMENT): as in
``expertd.server.frontends.decode`` (dtype, shape, bytes, H, token limit, NaN / Inf, token ids), plus
unknown parameters (Triton's sequence parameters: the layer is stateless).

``model_infer_header`` reads only the header fields (the inputs' names, datatype and shape) for
admission, before any tensor body; as in ``requests``, no check grows with a request's repeated
fields (at most MAX_INPUTS inputs are looked at) and every quoted value is bounded (``shown``).
"""
from __future__ import annotations

import math
import sys
import time

import ml_dtypes
import numpy as np

from expertd.server.batching.requests import ForwardRequest, Header
from expertd.server.engine import api
from expertd.server.engine.api import ModelDescription
from expertd.server.errors import InvalidRequest, UnknownLayerError, shown, shown_shape
from expertd.server.frontends.decode import check_shape, check_token_ids, check_tokens, required_token_ids
from expertd.server.frontends.shared_memory import SharedMemoryRegistry, Slot

MODEL_PREFIX = "moe-layer-"
MODEL_VERSION = "1"
INPUT, TOKEN_IDS = "hidden_states", "token_ids"
OUTPUT, TOPK_IDS, TOPK_WEIGHTS = "output", "router_topk_ids", "router_topk_weights"
OUTPUTS = (OUTPUT, TOPK_IDS, TOPK_WEIGHTS)
DATATYPES = {"BF16": np.dtype(ml_dtypes.bfloat16), "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32)}
INT32 = {"INT32": np.dtype(np.int32)}
SHM_REGION, SHM_OFFSET, SHM_BYTE_SIZE = "shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"
SHM_PARAMETERS = (SHM_REGION, SHM_OFFSET, SHM_BYTE_SIZE)
_TYPED_CONTENTS = {"FP32": "fp32_contents", "INT32": "int_contents"}
MAX_INPUTS = 2


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
    """A ModelInferRequest's Header (for ``layer``, ``layer_of_model`` of its model name), its tensor
    bodies untouched: at most MAX_INPUTS inputs, ``hidden_states`` among them once, its datatype
    and shape [T, H] with 1 <= T <= max_request_tokens."""
    hidden_size = model.layer(layer).hidden_size
    tensor = _hidden_states_header(request, hidden_size)
    check_shape(int(tensor.shape[0]), int(tensor.shape[1]), f"inputs[{INPUT!r}]", hidden_size, "H",
                model.max_request_tokens)
    return Header(layer, api.FORWARD, int(tensor.shape[0]))


def _hidden_states_header(request, hidden_size: int):
    """The ``hidden_states`` input, checked from its header: the inputs' names (at most MAX_INPUTS),
    its datatype and 2 dimensions."""
    inputs = request.inputs
    names = [tensor.name for tensor in inputs[:MAX_INPUTS]]
    if len(inputs) > MAX_INPUTS or names.count(INPUT) != 1 or len(set(names)) != len(names) \
            or set(names) - {INPUT, TOKEN_IDS}:
        shown_names = [shown(n) for n in names] + (["..."] if len(inputs) > MAX_INPUTS else [])
        raise InvalidRequest("inputs", f"expected {INPUT!r} [T, H={hidden_size}] and optionally {TOKEN_IDS!r} [T] "
                                       f"INT32, each once; got {len(inputs)}: [{', '.join(shown_names)}]")
    tensor = inputs[names.index(INPUT)]
    field = f"inputs[{INPUT!r}]"
    if tensor.datatype not in DATATYPES:
        raise InvalidRequest(f"{field}.datatype",
                             f"expected one of {', '.join(DATATYPES)}, got {shown(tensor.datatype)}")
    if len(tensor.shape) != 2:
        raise InvalidRequest(f"{field}.shape", f"expected [T, H={hidden_size}] with T >= 1, got "
                                               f"{shown_shape(tensor.shape)}")
    return tensor


def decode_model_infer(request, model: ModelDescription, layer: int, call_deadline: float | None,
                       shared_memory: SharedMemoryRegistry | None = None
                       ) -> tuple[ForwardRequest, list[str], dict[str, Slot]]:
    """A ModelInferRequest for ``layer`` (``layer_of_model`` of its model name) as a ForwardRequest,
    the names of the outputs it asks for, and the shared-memory slot of each output that names one.

    Its deadline is the earlier of the call's (``call_deadline``) and the ``timeout`` parameter.
    Without ``shared_memory`` (no registry), a tensor naming a region is INVALID_ARGUMENT.
    """
    deadline = infer_deadline(request, call_deadline)
    cfg = model.layer(layer)
    wire, token_ids = _inputs(request, cfg, model.max_request_tokens, shared_memory)
    token_ids = required_token_ids(token_ids, cfg, layer, f"inputs[{TOKEN_IDS!r}]")
    forward = ForwardRequest(layer, api.cast(wire, model.dtype), wire.dtype, deadline, f"inputs[{INPUT!r}]",
                             token_ids=token_ids)
    wanted, slots = _requested_outputs(request, shared_memory)
    needed = {OUTPUT: wire.nbytes, TOPK_IDS: len(wire) * cfg.topk * 4, TOPK_WEIGHTS: len(wire) * cfg.topk * 4}
    return forward, wanted, {name: _output_slot(parameters, needed[name], field, shared_memory)
                             for name, (parameters, field) in slots.items()}


def little_endian(array: np.ndarray) -> np.ndarray:
    """The array with little-endian element bytes (the wire order), whatever the host's order."""
    return array.byteswap() if sys.byteorder == "big" else array


def _check_parameters(parameters, field: str, allowed: tuple[str, ...]) -> None:
    for key in parameters:  # stops at the first unknown key: at most len(allowed) + 1 keys are read
        if key not in allowed:
            accepted = ", ".join(allowed) if allowed else "none"
            hint = " (sequence batching: the MoE layer is stateless)" if key.startswith("sequence_") else ""
            raise InvalidRequest(f"{field}[{shown(key)}]", f"unknown parameter{hint}; accepted: {accepted}")


def _non_negative_int(parameters, key: str, field: str = "parameters") -> int:
    """The integer value of parameter ``key`` (int64 or uint64, >= 0), 0 when absent."""
    if key not in parameters:
        return 0
    choice = parameters[key].WhichOneof("parameter_choice")
    value = getattr(parameters[key], choice) if choice in ("int64_param", "uint64_param") else -1
    if value < 0:
        raise InvalidRequest(f"{field}[{key!r}]", f"expected a non-negative integer, got {choice}")
    return value


def infer_deadline(request, call_deadline: float | None) -> float | None:
    """The earlier of the call's deadline and the ``timeout`` parameter (microseconds), monotonic."""
    _check_parameters(request.parameters, "parameters", ("timeout", "priority"))
    _non_negative_int(request.parameters, "priority")  # validated, then ignored: one priority level
    timeout_us = _non_negative_int(request.parameters, "timeout")
    deadlines = [d for d in (call_deadline, time.monotonic() + timeout_us / 1e6 if timeout_us else None)
                 if d is not None]
    return min(deadlines) if deadlines else None


def _inputs(request, cfg, max_tokens: int,
            shared_memory: SharedMemoryRegistry | None) -> tuple[np.ndarray, np.ndarray | None]:
    """(``hidden_states [T, H]`` in its wire dtype, ``token_ids [T]`` int32 or None), checked."""
    hidden_size = cfg.hidden_size
    _hidden_states_header(request, hidden_size)  # at most MAX_INPUTS inputs from here on
    raw_users = [i for i, t in enumerate(request.inputs) if SHM_REGION not in t.parameters and
                 not t.HasField("contents")]
    if request.raw_input_contents and len(request.raw_input_contents) != len(raw_users):
        typed = " (an input with contents has no raw entry: set either raw_input_contents or contents, not both)" \
            if any(t.HasField("contents") for t in request.inputs) else ""
        raise InvalidRequest("raw_input_contents", f"expected {len(raw_users)} entries (one per input sent neither "
                                                   f"in contents nor in shared memory), got "
                                                   f"{len(request.raw_input_contents)}{typed}")
    raw = {index: (k, entry) for k, (index, entry) in enumerate(zip(raw_users, request.raw_input_contents,
                                                                     strict=False))}
    arrays = {}
    for index, tensor in enumerate(request.inputs):
        dtypes, ndim, limit = (DATATYPES, 2, max_tokens * hidden_size) if tensor.name == INPUT else \
            (INT32, 1, max_tokens)
        arrays[tensor.name] = _input(tensor, raw.get(index), dtypes, ndim, limit, shared_memory)
    hidden = arrays[INPUT]
    check_tokens(hidden, f"inputs[{INPUT!r}]", hidden_size, "H", max_tokens)
    ids = arrays.get(TOKEN_IDS)
    return hidden, None if ids is None else check_token_ids(ids, len(hidden), f"inputs[{TOKEN_IDS!r}]",
                                                            cfg.hash_vocab_size)


def _input(tensor, raw: tuple[int, bytes] | None, dtypes: dict[str, np.dtype], ndim: int, limit: int,
           shared_memory: SharedMemoryRegistry | None) -> np.ndarray:
    """One input tensor in its wire dtype and shape, from raw bytes, typed contents or shared memory;
    its rank, dimensions and element count (at most ``limit``) checked before anything is read."""
    field = f"inputs[{tensor.name!r}]"
    _check_parameters(tensor.parameters, f"{field}.parameters", SHM_PARAMETERS)
    dtype = dtypes.get(tensor.datatype)
    if dtype is None:
        raise InvalidRequest(f"{field}.datatype", f"expected one of {', '.join(dtypes)}, got {shown(tensor.datatype)}")
    if len(tensor.shape) != ndim or min(tensor.shape) < 0:
        raise InvalidRequest(f"{field}.shape", f"expected {ndim} dimensions >= 0, got {shown_shape(tensor.shape)}")
    shape = tuple(int(d) for d in tensor.shape)
    count = math.prod(shape)
    if count > limit:
        raise InvalidRequest(f"{field}.shape", f"{shown_shape(shape)} holds {count} elements, more than the "
                                               f"{limit} of --max-request-tokens")
    if SHM_REGION in tensor.parameters:
        if tensor.HasField("contents"):
            raise InvalidRequest(f"{field}.contents", "set either shared memory or contents, not both")
        region, offset, byte_size = _shm_reference(tensor.parameters, f"{field}.parameters", shared_memory)
        return shared_memory.input_array(region, offset, byte_size, dtype, shape, f"{field}.parameters")
    if raw is not None:
        position, data = raw
        if len(data) != count * dtype.itemsize:
            raise InvalidRequest(f"raw_input_contents[{position}]", f"{tensor.name}: expected {count * dtype.itemsize} "
                                                                   f"bytes for {tensor.datatype} {list(shape)}, "
                                                                   f"got {len(data)}")
        return little_endian(np.frombuffer(data, dtype=dtype).reshape(shape))
    typed = _TYPED_CONTENTS.get(tensor.datatype)
    if typed is None:
        raise InvalidRequest(f"{field}.contents",
                             f"{tensor.datatype} has no typed contents field: send it in raw_input_contents")
    values = getattr(tensor.contents, typed)
    if len(values) != count:
        raise InvalidRequest(f"{field}.contents.{typed}", f"expected {count} values for shape {list(shape)}, "
                                                          f"got {len(values)}")
    return np.asarray(values, dtype=dtype).reshape(shape)


def _shm_reference(parameters, field: str, shared_memory: SharedMemoryRegistry | None) -> tuple[str, int, int]:
    """(region, offset, byte_size) of a tensor's shared-memory parameters, checked."""
    if shared_memory is None:
        raise InvalidRequest(f"{field}[{SHM_REGION!r}]", "this server does not take shared-memory tensors")
    region = parameters[SHM_REGION]
    if region.WhichOneof("parameter_choice") != "string_param":
        raise InvalidRequest(f"{field}[{SHM_REGION!r}]", "expected a string: the registered region's name")
    if SHM_BYTE_SIZE not in parameters:
        raise InvalidRequest(f"{field}[{SHM_BYTE_SIZE!r}]", "required with shared_memory_region")
    return (region.string_param, _non_negative_int(parameters, SHM_OFFSET, field),
            _non_negative_int(parameters, SHM_BYTE_SIZE, field))


def _requested_outputs(request, shared_memory: SharedMemoryRegistry | None) -> tuple[list[str], dict]:
    """The outputs asked for (all when none is), and for those naming a region: name -> (parameters, field)."""
    if not request.outputs:
        return list(OUTPUTS), {}
    names, slots = [], {}
    for index, output in enumerate(request.outputs):  # stops at the first bad one: at most 4 are read
        if output.name not in OUTPUTS:
            raise InvalidRequest(f"outputs[{index}].name",
                                 f"expected one of {', '.join(OUTPUTS)}, got {shown(output.name)}")
        if output.name in names:
            raise InvalidRequest(f"outputs[{index}].name", f"{output.name!r} requested twice")
        field = f"outputs[{output.name!r}].parameters"
        _check_parameters(output.parameters, field, SHM_PARAMETERS)
        if SHM_REGION in output.parameters:
            slots[output.name] = (output.parameters, field)
        names.append(output.name)
    return names, slots


def _output_slot(parameters, needed: int, field: str, shared_memory: SharedMemoryRegistry | None) -> Slot:
    region, offset, byte_size = _shm_reference(parameters, field, shared_memory)
    return shared_memory.output_slot(region, offset, byte_size, needed, field)
