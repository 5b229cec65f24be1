"""``ExpertdSession``: one vLLM engine's link to its expert server: the client, the MoE layers the
server computes, the start-up check and each layer's call. Needs torch and the client, not vLLM.

The layer boundary is expertd's ``Forward``: for decoder layer i the server computes the whole
sparse-MoE block of the Hugging Face model (router, routed experts, shared experts and their gate)
from the block's input ``[T, H]``. vLLM still builds its router gate and shared experts (and loads
their small weights) but the plugin's layer never runs them; only the routed experts' weights are
absent from the attention side.
"""
from __future__ import annotations

import logging

import torch

from expertd.client.client import ExpertClient
from expertd.client.errors import ExpertError, UnavailableError
from expertd.client.transformers.families import FAMILIES, Family, expected_layer
from expertd.client.transformers.offload import check_layers
from expertd.client.transformers.remote import from_wire, to_wire
from expertd.client.vllm.target import Target

logger = logging.getLogger("vllm.plugins.expertd")  # under vLLM's configured "vllm" logger

FAMILIES_BY_MODEL_TYPE: dict[str, Family] = {family.model_type: family for family in FAMILIES.values()}


STEP_ERROR_PREFIX = "expertd Forward of layer "


class ExpertdStepError(RuntimeError):
    """An expertd call failed during a vLLM forward pass; the message (``STEP_ERROR_PREFIX``...)
    names the layer, the tokens and the server's answer. The plugin fails that step's requests and
    the engine goes on."""


def family_for(hf_config) -> Family:
    """The expertd family of a vLLM model's (text) config; ValueError for a model type it lacks."""
    model_type = getattr(hf_config.get_text_config(), "model_type", None) or getattr(hf_config, "model_type", None)
    family = FAMILIES_BY_MODEL_TYPE.get(model_type)
    if family is None:
        raise ValueError(f"the expertd vLLM plugin does not know the MoE layers of model type {model_type!r} "
                         f"(known: {', '.join(sorted(FAMILIES_BY_MODEL_TYPE))}); unset the expertd target to run "
                         "this model's MoE layers in vLLM")
    return family


class ExpertdSession:
    """The MoE layers of one vLLM model, computed by the expert server ``target``.

    ``add_layer(index, name)`` is called as vLLM builds each MoE layer; ``check()`` compares them with
    the server's GetModelInfo (once; LayerMismatchError names every mismatch, a server that cannot be
    reached raises RuntimeError naming it); ``forward(x, layer)`` is one Forward of ``x [T, H]`` in its
    dtype (bfloat16 as bfloat16), the answer on x's device.
    """

    def __init__(self, target: Target, hf_config, *, client: ExpertClient | None = None):
        self.target = target
        self.family = family_for(hf_config)
        self.text_config = hf_config.get_text_config()
        self.layers: dict[int, str] = {}
        self._client = client
        self._checked = False

    def add_layer(self, index: int, name: str) -> None:
        if index in self.layers:
            raise ValueError(f"MoE layers {self.layers[index]} and {name} both have decoder-layer index {index}")
        self.layers[index] = name

    @property
    def client(self) -> ExpertClient:
        if self._client is None:
            self._client = ExpertClient(self.target.address, timeout=self.target.timeout_s)
        return self._client

    def check(self) -> None:
        """Raise unless the server holds every MoE layer of the model as the model has it."""
        if self._checked:
            return
        if not self.layers:
            raise ValueError(f"the expertd target is set ({self.target.source}={self.target.address}), but vLLM built "
                             "no MoE layer the plugin computes")
        specs = [expected_layer(self.family, self.text_config, index) for index in sorted(self.layers)]
        try:
            info = self.client.model_info()
        except ExpertError as error:
            raise RuntimeError(f"expertd vLLM plugin: cannot read the expert server's layers at {self.target.address} "
                               f"({self.target.source}): {error}") from None
        check_layers(specs, info, self.target.address)
        self._checked = True
        logger.info("expertd: MoE layers %s of this %s model run on the expert server at %s (%s); checked with "
                    "GetModelInfo", sorted(self.layers), self.family.model_type, self.target.address,
                    self.target.source)

    def forward(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """The server's output of decoder layer ``layer``'s MoE block for ``x [T, H]``."""
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        try:
            y = self.client.forward(to_wire(x), layer=layer)
        except ExpertError as error:
            if isinstance(error, UnavailableError):
                self.close()  # the next step connects afresh, not after the old channel's reconnect backoff
            raise ExpertdStepError(f"{STEP_ERROR_PREFIX}{layer} ({x.shape[0]} tokens, {x.dtype}) at "
                                   f"{self.target.address} failed: {error}") from None
        return from_wire(y, like=x)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
