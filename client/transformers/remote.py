"""``RemoteMoeBlock``: the module that stands in for one sparse-MoE block and calls the expert server,
and the torch <-> numpy conversions of the tensors it sends.

Tensors travel in the model's dtype: float32 and float16 as they are, bfloat16 as its 16-bit
pattern (a torch int16 view read by numpy as ``ml_dtypes.bfloat16``), never through float32. The
server answers in the request's dtype; the answer goes back to the input's device.
"""
from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np
import torch
from torch import nn
from transformers.utils import output_capturing

from expertd.client.transformers.families import Family

ExpertCall = Callable[..., np.ndarray]  # expert_call(x [T, H], layer=i) -> [T, H] in x's dtype (ExpertClient.forward)

_NUMPY_DTYPES = {torch.float32: np.dtype(np.float32), torch.float16: np.dtype(np.float16),
                 torch.bfloat16: np.dtype(ml_dtypes.bfloat16)}


def to_wire(x: torch.Tensor) -> np.ndarray:
    """``x [T, H]`` (float32, bfloat16 or float16, any device) as a numpy array of the same dtype."""
    if x.dtype not in _NUMPY_DTYPES:
        raise TypeError(f"hidden states must be float32, bfloat16 or float16 to go to the expert server, got {x.dtype}")
    x = x.detach().to("cpu").contiguous()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


def from_wire(y: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """The server's answer ``y [T, H]`` as a torch tensor of ``like``'s dtype on ``like``'s device."""
    if y.dtype != _NUMPY_DTYPES[like.dtype]:
        raise TypeError(f"the expert server answered {y.dtype} for a {like.dtype} request")
    y = np.array(y)  # writable: decoded answers are read-only views of the message bytes
    tensor = torch.from_numpy(y.view(np.int16)).view(torch.bfloat16) if like.dtype == torch.bfloat16 else \
        torch.from_numpy(y)
    return tensor.to(like.device)


# transformers 5.x records extra outputs (router logits, ...) through this context variable.
_OUTPUT_COLLECTOR = getattr(output_capturing, "_active_collector", None)


def router_logits_requested() -> bool:
    """Whether the running forward records router logits (``output_router_logits=True``)."""
    collector = _OUTPUT_COLLECTOR.get() if _OUTPUT_COLLECTOR is not None else None
    return bool(collector) and "router_logits" in collector


class RemoteMoeBlock(nn.Module):
    """Decoder layer ``layer``'s sparse-MoE block, computed by the expert server.

    ``forward(hidden_states [batch, seq, H]) -> [batch, seq, H]`` (or what the family's block returns:
    see :class:`~expertd.client.transformers.families.Family`): the tokens are flattened to ``[T, H]``,
    sent in the input's dtype to ``expert_call(x, layer=layer)`` (one Forward: router, routed and shared
    experts on the server, whose routing is authoritative) and the answer reshaped. Blocks that return
    ``(output, router output)`` get ``(output, None)``: no router output is computed here. No gradient
    flows through the block.

    Router logits: when the caller asks for them (``output_router_logits``), the kept local block's
    router (``local``, with ``keep_local=True``) computes them from the same weights; without it the
    block raises, naming the layer.

    ``local`` is the original block when it was kept (a child module, so its weights stay in the
    model's parameters and state dict under ``<path>.local.``), else None.
    """

    expertd_offloaded = True  # find_moe_blocks skips this block and the original it keeps

    def __init__(self, expert_call: ExpertCall, layer: int, family: Family, local: nn.Module | None = None):
        super().__init__()
        self.expert_call = expert_call
        self.layer = int(layer)
        self.family = family
        self.local = local

    def forward(self, hidden_states: torch.Tensor):
        hidden = hidden_states.shape[-1]
        flat = hidden_states.reshape(-1, hidden)
        if router_logits_requested():
            if self.local is None:
                raise RuntimeError(
                    f"router logits were asked for (output_router_logits), but layer {self.layer}'s router is on "
                    "the expert server only: offload with keep_local=True to compute them locally, or leave "
                    "output_router_logits off")
            getattr(self.local, self.family.router)(flat)  # transformers records the logits from the router
        if flat.shape[0] == 0:
            out = torch.zeros_like(flat)
        else:
            out = from_wire(self.expert_call(to_wire(flat), layer=self.layer), like=flat)
        if not self.family.flat_output:
            out = out.reshape(hidden_states.shape)
        return (out, None) if self.family.returns_router else out

    def extra_repr(self) -> str:
        return f"layer={self.layer}, family={self.family.model_type}, local={'kept' if self.local else 'dropped'}"
