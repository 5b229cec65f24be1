# Regenerate with `make protos` (python -m expertd.client.protos); do not edit.
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT16: DType
DTYPE_INT32: DType

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data", "shared_memory")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    shared_memory: SharedMemoryRef
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., shared_memory: _Optional[_Union[SharedMemoryRef, _Mapping]] = ...) -> None: ...

class SharedMemoryRef(_message.Message):
    __slots__ = ("region", "offset", "byte_size")
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    region: str
    offset: int
    byte_size: int
    def __init__(self, region: _Optional[str] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ...) -> None: ...

class Routing(_message.Message):
    __slots__ = ("topk_ids", "topk_weights", "tokens_per_expert")
    TOPK_IDS_FIELD_NUMBER: _ClassVar[int]
    TOPK_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_EXPERT_FIELD_NUMBER: _ClassVar[int]
    topk_ids: Tensor
    topk_weights: Tensor
    tokens_per_expert: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, topk_ids: _Optional[_Union[Tensor, _Mapping]] = ..., topk_weights: _Optional[_Union[Tensor, _Mapping]] = ..., tokens_per_expert: _Optional[_Iterable[int]] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("layer", "hidden_states", "return_routing", "request_id", "token_ids", "output_shared_memory")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    RETURN_ROUTING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    layer: int
    hidden_states: Tensor
    return_routing: bool
    request_id: str
    token_ids: Tensor
    output_shared_memory: SharedMemoryRef
    def __init__(self, layer: _Optional[int] = ..., hidden_states: _Optional[_Union[Tensor, _Mapping]] = ..., return_routing: _Optional[bool] = ..., request_id: _Optional[str] = ..., token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., output_shared_memory: _Optional[_Union[SharedMemoryRef, _Mapping]] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("output", "routing", "request_id", "error")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    output: Tensor
    routing: Routing
    request_id: str
    error: Error
    def __init__(self, output: _Optional[_Union[Tensor, _Mapping]] = ..., routing: _Optional[_Union[Routing, _Mapping]] = ..., request_id: _Optional[str] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("layer", "hidden_states", "logits", "aux_loss_coeff", "request_id", "token_ids")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    AUX_LOSS_COEFF_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    hidden_states: Tensor
    logits: Tensor
    aux_loss_coeff: float
    request_id: str
    token_ids: Tensor
    def __init__(self, layer: _Optional[int] = ..., hidden_states: _Optional[_Union[Tensor, _Mapping]] = ..., logits: _Optional[_Union[Tensor, _Mapping]] = ..., aux_loss_coeff: _Optional[float] = ..., request_id: _Optional[str] = ..., token_ids: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("routing", "aux_loss", "request_id")
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    AUX_LOSS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    routing: Routing
    aux_loss: float
    request_id: str
    def __init__(self, routing: _Optional[_Union[Routing, _Mapping]] = ..., aux_loss: _Optional[float] = ..., request_id: _Optional[str] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RouterSettings(_message.Message):
    __slots__ = ("score_function", "use_pre_softmax", "num_groups", "group_topk", "scaling_factor", "has_expert_bias", "norm_topk_prob")
    SCORE_FUNCTION_FIELD_NUMBER: _ClassVar[int]
    USE_PRE_SOFTMAX_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    GROUP_TOPK_FIELD_NUMBER: _ClassVar[int]
    SCALING_FACTOR_FIELD_NUMBER: _ClassVar[int]
    HAS_EXPERT_BIAS_FIELD_NUMBER: _ClassVar[int]
    NORM_TOPK_PROB_FIELD_NUMBER: _ClassVar[int]
    score_function: str
    use_pre_softmax: bool
    num_groups: int
    group_topk: int
    scaling_factor: float
    has_expert_bias: bool
    norm_topk_prob: bool
    def __init__(self, score_function: _Optional[str] = ..., use_pre_softmax: _Optional[bool] = ..., num_groups: _Optional[int] = ..., group_topk: _Optional[int] = ..., scaling_factor: _Optional[float] = ..., has_expert_bias: _Optional[bool] = ..., norm_topk_prob: _Optional[bool] = ...) -> None: ...

class LayerInfo(_message.Message):
    __slots__ = ("index", "hidden_size", "intermediate_size", "num_experts", "topk", "router", "num_shared_experts", "shared_intermediate_size", "shared_expert_gate", "activation", "placement")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    INTERMEDIATE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    ROUTER_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    SHARED_INTERMEDIATE_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHARED_EXPERT_GATE_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    index: int
    hidden_size: int
    intermediate_size: int
    num_experts: int
    topk: int
    router: RouterSettings
    num_shared_experts: int
    shared_intermediate_size: int
    shared_expert_gate: bool
    activation: str
    placement: ExpertPlacement
    def __init__(self, index: _Optional[int] = ..., hidden_size: _Optional[int] = ..., intermediate_size: _Optional[int] = ..., num_experts: _Optional[int] = ..., topk: _Optional[int] = ..., router: _Optional[_Union[RouterSettings, _Mapping]] = ..., num_shared_experts: _Optional[int] = ..., shared_intermediate_size: _Optional[int] = ..., shared_expert_gate: _Optional[bool] = ..., activation: _Optional[str] = ..., placement: _Optional[_Union[ExpertPlacement, _Mapping]] = ...) -> None: ...

class ExpertPlacement(_message.Message):
    __slots__ = ("num_ranks", "slots_per_rank", "physical_to_logical", "replica_counts", "num_redundant_experts", "version")
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_TO_LOGICAL_FIELD_NUMBER: _ClassVar[int]
    REPLICA_COUNTS_FIELD_NUMBER: _ClassVar[int]
    NUM_REDUNDANT_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    num_ranks: int
    slots_per_rank: int
    physical_to_logical: _containers.RepeatedScalarFieldContainer[int]
    replica_counts: _containers.RepeatedScalarFieldContainer[int]
    num_redundant_experts: int
    version: int
    def __init__(self, num_ranks: _Optional[int] = ..., slots_per_rank: _Optional[int] = ..., physical_to_logical: _Optional[_Iterable[int]] = ..., replica_counts: _Optional[_Iterable[int]] = ..., num_redundant_experts: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class Mesh(_message.Message):
    __slots__ = ("axis_names", "axis_sizes", "platform", "num_devices")
    AXIS_NAMES_FIELD_NUMBER: _ClassVar[int]
    AXIS_SIZES_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICES_FIELD_NUMBER: _ClassVar[int]
    axis_names: _containers.RepeatedScalarFieldContainer[str]
    axis_sizes: _containers.RepeatedScalarFieldContainer[int]
    platform: str
    num_devices: int
    def __init__(self, axis_names: _Optional[_Iterable[str]] = ..., axis_sizes: _Optional[_Iterable[int]] = ..., platform: _Optional[str] = ..., num_devices: _Optional[int] = ...) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model", "layers", "dtype", "buckets", "max_batch_tokens", "max_request_tokens", "mesh", "server_version", "input_dtypes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MESH_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    INPUT_DTYPES_FIELD_NUMBER: _ClassVar[int]
    model: str
    layers: _containers.RepeatedCompositeFieldContainer[LayerInfo]
    dtype: DType
    buckets: _containers.RepeatedScalarFieldContainer[int]
    max_batch_tokens: int
    max_request_tokens: int
    mesh: Mesh
    server_version: str
    input_dtypes: _containers.RepeatedScalarFieldContainer[DType]
    def __init__(self, model: _Optional[str] = ..., layers: _Optional[_Iterable[_Union[LayerInfo, _Mapping]]] = ..., dtype: _Optional[_Union[DType, str]] = ..., buckets: _Optional[_Iterable[int]] = ..., max_batch_tokens: _Optional[int] = ..., max_request_tokens: _Optional[int] = ..., mesh: _Optional[_Union[Mesh, _Mapping]] = ..., server_version: _Optional[str] = ..., input_dtypes: _Optional[_Iterable[_Union[DType, str]]] = ...) -> None: ...

class GetExpertLoadRequest(_message.Message):
    __slots__ = ("layers",)
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layers: _Optional[_Iterable[int]] = ...) -> None: ...

class ExpertLoad(_message.Message):
    __slots__ = ("layer", "tokens_total", "tokens_recent", "window_seconds", "placement", "rank_tokens_recent", "balancedness")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_RECENT_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    RANK_TOKENS_RECENT_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    tokens_total: _containers.RepeatedScalarFieldContainer[int]
    tokens_recent: _containers.RepeatedScalarFieldContainer[int]
    window_seconds: float
    placement: ExpertPlacement
    rank_tokens_recent: _containers.RepeatedScalarFieldContainer[float]
    balancedness: float
    def __init__(self, layer: _Optional[int] = ..., tokens_total: _Optional[_Iterable[int]] = ..., tokens_recent: _Optional[_Iterable[int]] = ..., window_seconds: _Optional[float] = ..., placement: _Optional[_Union[ExpertPlacement, _Mapping]] = ..., rank_tokens_recent: _Optional[_Iterable[float]] = ..., balancedness: _Optional[float] = ...) -> None: ...

class GetExpertLoadResponse(_message.Message):
    __slots__ = ("layers",)
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[ExpertLoad]
    def __init__(self, layers: _Optional[_Iterable[_Union[ExpertLoad, _Mapping]]] = ...) -> None: ...

class RegisterSharedMemoryRequest(_message.Message):
    __slots__ = ("name", "key", "offset", "byte_size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    key: str
    offset: int
    byte_size: int
    def __init__(self, name: _Optional[str] = ..., key: _Optional[str] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ...) -> None: ...

class RegisterSharedMemoryResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UnregisterSharedMemoryRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnregisterSharedMemoryResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetSharedMemoryStatusRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetSharedMemoryStatusResponse(_message.Message):
    __slots__ = ("regions",)
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.RepeatedCompositeFieldContainer[RegisterSharedMemoryRequest]
    def __init__(self, regions: _Optional[_Iterable[_Union[RegisterSharedMemoryRequest, _Mapping]]] = ...) -> None: ...
