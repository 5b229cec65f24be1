"""What the front ends know of the served model: a read-only description, built once at start-up.

The servicers (expertd.v1, KServe) validate requests and answer model-info calls from it; they
never see the engine. Shapes: H hidden size, E routed experts, k experts per token.
"""
from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping

import numpy as np

from expertd.kernels.config import MoEConfig
from expertd.server.errors import UnknownLayerError


@dataclasses.dataclass(frozen=True)
class MeshDescription:
    """The device mesh: its axis name, size (devices) and platform ("cpu", "gpu", ...)."""

    axis: str
    size: int
    platform: str


@dataclasses.dataclass(frozen=True)
class ModelDescription:
    """The served layers and the limits a request must keep to.

    name: the checkpoint directory or preset name.
    layers: layer index -> its MoEConfig (H, I, E, k, router settings, shared experts), read-only.
    dtype: the engine's compute dtype; requests are cast to it once, when decoded.
    buckets: the compiled token buckets, ascending.
    max_request_tokens: tokens one request may carry.
    max_batch_tokens: rows merged into one engine step at most (requests are split into parts of this size).
    mesh: the device mesh.
    """

    name: str
    layers: Mapping[int, MoEConfig]
    dtype: np.dtype
    buckets: tuple[int, ...]
    max_request_tokens: int
    max_batch_tokens: int
    mesh: MeshDescription

    def __post_init__(self):
        object.__setattr__(self, "layers", types.MappingProxyType(dict(sorted(self.layers.items()))))
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        object.__setattr__(self, "buckets", tuple(self.buckets))

    def layer(self, index: int) -> MoEConfig:
        """Layer ``index``'s config; UnknownLayerError (NOT_FOUND) listing the layers served otherwise."""
        cfg = self.layers.get(index)
        if cfg is None:
            raise UnknownLayerError(f"layer {index} is not served; layers: {list(self.layers)}")
        return cfg

    def bucket_for(self, num_tokens: int) -> int:
        """The smallest bucket holding ``num_tokens`` rows (1 <= num_tokens <= max_batch_tokens)."""
        for bucket in self.buckets:
            if bucket >= num_tokens:
                return bucket
        raise ValueError(f"num_tokens={num_tokens} exceeds the largest bucket {self.buckets[-1]}")

    def max_message_bytes(self) -> int:
        """The largest gRPC message of a request of max_request_tokens tokens, in or out, plus framing headroom.

        Per token: fp32 hidden states or logits in, output plus fp32 routing ids / weights out.
        """
        per_token = max(4 * max(c.hidden_size, c.num_experts) + 8 * c.topk for c in self.layers.values())
        return self.max_request_tokens * per_token + (1 << 20)
