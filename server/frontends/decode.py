"""Requests as the batcher takes them: decoded and validated once, at the edge, by one function per
wire format, and cast once to the engine's dtype.

| wire message | decoder | request |
|---|---|---|
| expertd.v1 ForwardRequest (Forward, each ForwardStream message) | ``decode_forward`` | ForwardRequest |
| expertd.v1 ForwardRequest, each call of a batch the native port took | ``decode_plain_forward`` | ForwardRequest |
| expertd.v1 RouteRequest | ``decode_route`` | RouteRequest |
| KServe v2 ModelInferRequest | ``kserve_requests.decode_model_infer`` | ForwardRequest (+ the outputs asked for) |

Every decoder checks against the read-only ``ModelDescription``: the layer is served
(``UnknownLayerError``: NOT_FOUND), then, naming the field (``InvalidRequest``: INVALID_ARGUMENT),
dtype, shape, byte length, width (H, or E for logits), the token limit 1 <= T <= max_request_tokens
and NaN / Inf (``check_tokens``, shared). Nothing after the decoder checks a request again.

Headers first: ``forward_header``, ``route_header`` and ``model_infer_header`` read only a
request's header fields (layer or model, dtype, the number of dimensions and the shape) and give
the ``Header`` admission decides on, before the tensor body is touched; each decoder takes that
Header and checks only the body (given none, it reads the header itself first). Their cost does
not grow with the request: a repeated field is measured with ``len`` and at most a few of its
entries are read, and every value an error message quotes is bounded (``errors.shown``).

Casts: a token array changes dtype at most twice on its way through the server, both times through
``cast``: here, from the wire dtype to the engine's (no copy when they are equal), and once in the
batcher, from the engine's dtype to the caller's. Shapes: T tokens, H hidden, E routed experts.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from expertd.client import admission, codec
from expertd.client.pb.v1 import expert_pb2
from expertd.server.batching.requests import ForwardRequest, Header, RouteRequest
from expertd.server.engine import api
from expertd.server.engine.api import ModelDescription
from expertd.server.errors import InvalidRequest, shown_shape
from expertd.server.frontends.shared_memory import SharedMemoryRegistry, Slot


def check_tokens(array: np.ndarray, field: str, width: int, width_name: str, max_tokens: int) -> None:
    """Shape ``[T, width]`` with 1 <= T <= max_tokens and no NaN / Inf (InvalidRequest otherwise)."""
    check_shape(*array.shape, field, width, width_name, max_tokens)
    check_finite(array, field)


def check_finite(array: np.ndarray, field: str) -> None:
    """No NaN / Inf in ``array [T, width]`` (InvalidRequest naming the first token holding one)."""
    row = _first_non_finite_row(array)
    if row is not None:
        raise InvalidRequest(field, f"contains NaN or Inf (first at token {row})")


# 16-bit floats are NaN or Inf exactly when their exponent bits are all set; testing the bits as
# integers is several times faster than ml_dtypes' isfinite on bfloat16 (float32: numpy's own).
_EXPONENT_BITS = {np.dtype(ml_dtypes.bfloat16): 0x7F80, np.dtype(np.float16): 0x7C00}


def _first_non_finite_row(array: np.ndarray) -> int | None:
    """The first row of ``array [T, width]`` holding a NaN or Inf, or None."""
    mask = _EXPONENT_BITS.get(array.dtype)
    if mask is not None and array.flags.c_contiguous:
        exponents = array.view(np.uint16) & mask
        if exponents.max(initial=0) < mask:  # the common case in two array operations
            return None
        bad = exponents == mask
    else:
        finite = np.isfinite(array)
        if finite.all():
            return None
        bad = ~finite
    return int(np.argmax(bad.any(axis=1)))


def check_token_ids(array: np.ndarray, num_tokens: int, field: str = "token_ids", vocab: int = 0) -> np.ndarray:
    """``array`` as ``token_ids [T]`` int32 for ``num_tokens`` tokens: int32, rank 1, length T,
    every id >= 0 and, for a hash-routed layer (``vocab`` > 0: its ``hash_vocab_size``), < vocab
    (InvalidRequest naming ``field`` otherwise): checked here, at the edge, never in a merged step."""
    if array.dtype != np.int32:
        raise InvalidRequest(f"{field}.dtype", f"expected int32 token ids, got {array.dtype}")
    if array.ndim != 1 or len(array) != num_tokens:
        raise InvalidRequest(f"{field}.shape", f"expected [T={num_tokens}] (one id per token), "
                                               f"got {list(array.shape)}")
    if array.size and int(array.min()) < 0:
        bad = int(np.argmax(array < 0))
        raise InvalidRequest(field, f"expected ids >= 0, got {int(array[bad])} at token {bad}")
    if vocab and array.size and int(array.max()) >= vocab:
        bad = int(np.argmax(array >= vocab))
        raise InvalidRequest(field, f"expected ids < {vocab} (the layer's hash vocabulary), got {int(array[bad])} "
                                    f"at token {bad}")
    return array


def required_token_ids(ids: np.ndarray | None, cfg, layer: int, field: str = "token_ids") -> np.ndarray | None:
    """``ids``, or InvalidRequest naming ``field`` when a hash-routed layer (``cfg.hash_routed``) got none."""
    if ids is None and cfg.hash_routed:
        raise InvalidRequest(field, f"required: layer {layer} is hash-routed (expert ids come from "
                                    f"tid2eid[token_id], vocabulary {cfg.hash_vocab_size}); send one int32 token "
                                    "id per token")
    return ids


# ---------------------------------------------------------------------- expertd.v1

def forward_header(message: expert_pb2.ForwardRequest, model: ModelDescription) -> Header:
    """A Forward (or ForwardStream) message's Header, its tensor body untouched."""
    cfg = model.layer(message.layer)
    tensor = message.hidden_states if message.HasField("hidden_states") else None
    tokens = _tensor_header(tensor, "hidden_states", cfg.hidden_size, "H", model.max_request_tokens)
    return Header(message.layer, api.FORWARD, tokens, _body_elements(tensor, tokens, cfg.hidden_size))


MAX_ADMISSION_CHARS = 32  # "<layer>,<tokens>": two decimal integers


def admission_header(metadata, model: ModelDescription) -> Header:
    """The Header a Forward call's ``admission.ADMISSION_METADATA`` declares, ``"<layer>,<tokens>"``
    (the first such entry of ``metadata``): NOT_FOUND for a layer not served, InvalidRequest naming
    the key for anything else but two decimal integers with 1 <= tokens <= max_request_tokens."""
    value = _metadata_value(metadata, admission.ADMISSION_METADATA) or ""
    layer, _, tokens = value.partition(",")
    if len(value) > MAX_ADMISSION_CHARS or not all(part.isascii() and part.isdigit() for part in (layer, tokens)):
        raise InvalidRequest(f"metadata {admission.ADMISSION_METADATA!r}", "must be '<layer>,<tokens>' (two decimal "
                             f"integers), got {value[:MAX_ADMISSION_CHARS]!r}")
    cfg = model.layer(int(layer))
    if not 1 <= int(tokens) <= model.max_request_tokens:
        raise InvalidRequest(f"metadata {admission.ADMISSION_METADATA!r}", f"tokens must be in [1, "
                             f"{model.max_request_tokens}], got {tokens}")
    return Header(int(layer), api.FORWARD, int(tokens), int(tokens) * cfg.hidden_size)


def expects_admission(metadata) -> bool:
    """Whether a Forward call holds its message until told it is admitted (``admission.EXPECT_METADATA``);
    InvalidRequest naming the key for a value the server does not know."""
    key, wanted = admission.EXPECT_METADATA
    value = _metadata_value(metadata, key)
    if value is None:
        return False
    if value != wanted:
        raise InvalidRequest(f"metadata {key!r}", f"must be {wanted!r}, got {value[:MAX_ADMISSION_CHARS]!r}")
    return True


def _metadata_value(metadata, key: str) -> str | None:
    """The value of the first ``key`` entry of a call's metadata (bytes read as latin-1), or None."""
    value = next((v for k, v in metadata or () if k == key), None)
    return value.decode("latin-1") if isinstance(value, bytes) else value


def decode_forward(message: expert_pb2.ForwardRequest, model: ModelDescription, deadline: float | None,
                   shared_memory: SharedMemoryRegistry | None = None, header: Header | None = None) -> ForwardRequest:
    """A Forward (or ForwardStream) message as a ForwardRequest (its hidden states may be in a
    region of ``shared_memory``); ``header``: what ``forward_header`` gave for it (None: read here)."""
    if header is None:
        header = forward_header(message, model)
    wire = _tensor_body(message.hidden_states, "hidden_states", header.tokens, model.layer(message.layer).hidden_size,
                        shared_memory)
    return ForwardRequest(message.layer, api.cast(wire, model.dtype), wire.dtype, deadline,
                          token_ids=_token_ids(message, len(wire), model.layer(message.layer), shared_memory))


def decode_plain_forward(message: expert_pb2.ForwardRequest, model: ModelDescription, deadline: float | None,
                         elsewhere: str) -> ForwardRequest:
    """A Forward message for a transport that serves its tensors in the message only and no routing
    (the native port): checked and decoded as Forward is (``forward_header``, ``decode_forward``),
    ``return_routing`` and shared-memory tensors refused naming the field and ``elsewhere`` (where
    they are served)."""
    header = forward_header(message, model)
    if message.return_routing:
        raise InvalidRequest("return_routing", f"routing is returned on {elsewhere}")
    for field, tensor in (("hidden_states", message.hidden_states), ("token_ids", message.token_ids)):
        if tensor.HasField("shared_memory"):
            raise InvalidRequest(f"{field}.shared_memory", f"shared memory is served on {elsewhere}")
    if message.HasField("output_shared_memory"):
        raise InvalidRequest("output_shared_memory", f"shared memory is served on {elsewhere}")
    return decode_forward(message, model, deadline, None, header)


def route_header(message: expert_pb2.RouteRequest, model: ModelDescription) -> Header:
    """A Route message's Header, its tensor body untouched."""
    cfg = model.layer(message.layer)
    which, width, name = _route_input(message, cfg)
    tensor = getattr(message, which)
    tokens = _tensor_header(tensor, which, width, name, model.max_request_tokens)
    return Header(message.layer, api.ROUTE_LOGITS if which == "logits" else api.ROUTE_HIDDEN, tokens,
                  _body_elements(tensor, tokens, width))


def decode_route(message: expert_pb2.RouteRequest, model: ModelDescription, default_aux_loss_coeff: float,
                 deadline: float | None, shared_memory: SharedMemoryRegistry | None = None,
                 header: Header | None = None) -> RouteRequest:
    """A Route message as a RouteRequest (the aux-loss coefficient defaults to ``default_aux_loss_coeff``);
    ``header``: what ``route_header`` gave for it (None: read here)."""
    if header is None:
        header = route_header(message, model)
    which, width, _ = _route_input(message, model.layer(message.layer))
    wire = _tensor_body(getattr(message, which), which, header.tokens, width, shared_memory)
    coeff = message.aux_loss_coeff if message.HasField("aux_loss_coeff") else default_aux_loss_coeff
    if not (np.isfinite(coeff) and coeff >= 0):
        raise InvalidRequest("aux_loss_coeff", f"must be finite and >= 0, got {coeff}")
    from_logits = which == "logits"
    tokens = api.cast(wire, np.float32 if from_logits else model.dtype)
    return RouteRequest(message.layer, tokens, from_logits, float(coeff), deadline, which,
                        token_ids=_token_ids(message, len(wire), model.layer(message.layer), shared_memory))


def _route_input(message: expert_pb2.RouteRequest, cfg) -> tuple[str, int, str]:
    """(the input field set, its width, the width's name)."""
    which = message.WhichOneof("input")
    if which is None:
        raise InvalidRequest("input", "set hidden_states [T, H] or logits [T, E]")
    return (which, cfg.num_experts, "E") if which == "logits" else (which, cfg.hidden_size, "H")


def _body_elements(tensor, tokens: int, width: int) -> int:
    return 0 if tensor.HasField("shared_memory") else tokens * width


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
    check_shape(tokens, columns, field, width, width_name, max_tokens)
    return tokens


def check_shape(tokens: int, columns: int, field: str, width: int, width_name: str, max_tokens: int) -> None:
    if columns != width:
        raise InvalidRequest(f"{field}.shape", f"expected [T, {width_name}={width}], got [{tokens}, {columns}]")
    if not 1 <= tokens <= max_tokens:
        raise InvalidRequest(f"{field}.shape", f"expected 1 <= T <= {max_tokens} tokens (--max-request-tokens), "
                                               f"got T={tokens}")


def _shared_tensor(tensor: expert_pb2.Tensor, field: str, shared_memory: SharedMemoryRegistry | None) -> np.ndarray:
    """A float ``[T, W]`` tensor whose bytes are in a registered region (read-only, the server's copy)."""
    if tensor.dtype not in codec.FLOAT_DTYPES:
        expected = ", ".join(codec.dtype_name(d) for d in codec.FLOAT_DTYPES)
        raise InvalidRequest(f"{field}.dtype", f"expected one of {expected}, got {codec.dtype_name(tensor.dtype)}")
    if len(tensor.shape) != 2 or min(tensor.shape) < 0:
        raise InvalidRequest(f"{field}.shape", f"expected 2 dimensions >= 0, got {shown_shape(tensor.shape)}")
    shape = (int(tensor.shape[0]), int(tensor.shape[1]))
    return _shared_input(tensor, field, shared_memory, codec.numpy_dtype(tensor.dtype), shape)


def _shared_input(tensor, field: str, shared_memory: SharedMemoryRegistry | None, dtype, shape) -> np.ndarray:
    """The ``shape`` ``dtype`` array a tensor's ``shared_memory`` reference names (InvalidRequest when
    shared memory is off, or the tensor carries bytes too)."""
    if shared_memory is None:
        raise InvalidRequest(f"{field}.shared_memory", "shared memory is off on this server "
                                                       "(--shared-memory-regions 0)")
    if tensor.data:
        raise InvalidRequest(f"{field}.data", "must be empty when shared_memory names the bytes")
    ref = tensor.shared_memory
    return shared_memory.input_array(ref.region, ref.offset, ref.byte_size, dtype, shape, f"{field}.shared_memory")


def _token_ids(message, num_tokens: int, cfg, shared_memory: SharedMemoryRegistry | None) -> np.ndarray | None:
    """The message's ``token_ids [T]`` int32 (in the message or a region of ``shared_memory``),
    checked: its dtype and shape before any of it is read, then its values (``check_token_ids``);
    None when it has none and the layer is not hash-routed."""
    if not message.HasField("token_ids"):
        return required_token_ids(None, cfg, message.layer)
    tensor = message.token_ids
    if tensor.dtype != expert_pb2.DTYPE_INT32:
        raise InvalidRequest("token_ids.dtype", f"expected int32 token ids, got {codec.dtype_name(tensor.dtype)}")
    if len(tensor.shape) != 1 or int(tensor.shape[0]) != num_tokens:
        raise InvalidRequest("token_ids.shape", f"expected [T={num_tokens}] (one id per token), got "
                                                f"{shown_shape(tensor.shape)}")
    if tensor.HasField("shared_memory"):
        array = _shared_input(tensor, "token_ids", shared_memory, np.dtype(np.int32), (num_tokens,))
    else:
        try:
            array = codec.decode(tensor, field="token_ids", dtypes=(expert_pb2.DTYPE_INT32,), ndim=1)
        except codec.TensorError as exc:
            raise InvalidRequest(exc.field, exc.description) from None
    return check_token_ids(array, num_tokens, vocab=cfg.hash_vocab_size)


def output_slot(message: expert_pb2.ForwardRequest, request: ForwardRequest,
                shared_memory: SharedMemoryRegistry | None) -> Slot | None:
    """Where ``output_shared_memory`` asks the output ``[T, H]`` (the caller's dtype) to be written,
    checked before compute; None when the output goes back in the response."""
    if not message.HasField("output_shared_memory"):
        return None
    field = "output_shared_memory"
    if shared_memory is None:
        raise InvalidRequest(field, "shared memory is off on this server (--shared-memory-regions 0)")
    ref = message.output_shared_memory
    needed = request.tokens.shape[0] * request.tokens.shape[1] * request.out_dtype.itemsize
    return shared_memory.output_slot(ref.region, ref.offset, ref.byte_size, needed, field)


def _tensor_body(tensor, field: str, tokens: int, width: int, shared_memory: SharedMemoryRegistry | None) -> np.ndarray:
    """The body of ``tensor``, whose header (a float dtype, shape ``[tokens, width]``) is checked
    already: a read-only ``[T, width]`` array of the wire dtype, free of NaN / Inf, its bytes in the
    message or in a region of ``shared_memory`` (a view, no copy)."""
    try:
        if tensor.HasField("shared_memory"):
            array = _shared_tensor(tensor, field, shared_memory)
        else:
            array = codec.from_bytes(tensor.data, codec.numpy_dtype(tensor.dtype), (tokens, width), field=field)
    except codec.TensorError as exc:
        raise InvalidRequest(exc.field, exc.description) from None
    check_finite(array, field)
    return array
