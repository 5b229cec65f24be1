"""The vLLM classes that put a model's MoE layers on expertd (vLLM 0.32's MoE layer structure).

vLLM builds each MoE layer with ``FusedMoEFactory``: a router, ``RoutedExperts`` (which owns the
expert weights through its quant method) and a ``MoERunner`` (what the model calls with the
layer's hidden states; it applies the gate when it holds one and runs the shared experts). The
plugin registers out-of-tree replacements of the last two (``PluggableLayer.register_oot``):

1. ``ExpertdRoutedExperts``: when the engine has an expertd target, its quant method is
   ``ExpertdMoEMethod``, which creates no weights (the routed experts never exist on this side);
   otherwise it is vLLM's own class unchanged.
2. ``ExpertdMoERunner``: when the engine has a target, ``forward(hidden_states [T, H], ...)`` is one
   expertd Forward of the whole block (router, routed and shared experts on the server: see
   :mod:`expertd.client.vllm.session`) through the custom op ``torch.ops.vllm.expertd_moe_forward``
   (opaque to torch.compile); vLLM's router logits and shared experts are not used. Otherwise
   vLLM's own forward.

Without a target (neither ``EXPERTD_VLLM_TARGET`` nor ``additional_config expertd.target``) every
method is vLLM's.
"""
from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
from vllm.utils.torch_utils import direct_register_custom_op

from expertd.client.vllm.session import ExpertdSession
from expertd.client.vllm.target import configured_target

# id(VllmConfig) -> (the config, its session): one session per engine built in this process.
_SESSIONS: dict[int, tuple[object, ExpertdSession]] = {}


def session_for(vllm_config) -> ExpertdSession | None:
    """The expertd session of the engine being built, or None when it has no expertd target."""
    entry = _SESSIONS.get(id(vllm_config))
    if entry is not None and entry[0] is vllm_config:
        return entry[1]
    target = configured_target(getattr(vllm_config, "additional_config", None))
    if target is None:
        return None
    session = ExpertdSession(target, vllm_config.model_config.hf_config)
    _SESSIONS[id(vllm_config)] = (vllm_config, session)
    return session


def sessions() -> list[ExpertdSession]:
    return [session for _, session in _SESSIONS.values()]


class ExpertdMoEMethod(FusedMoEMethodBase):
    """The quant method of routed experts computed by expertd: no weights, nothing to apply here."""

    def __init__(self, moe, session: ExpertdSession):
        super().__init__(moe)
        self.session = session

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
        pass  # the expert server holds them

    def get_fused_moe_quant_config(self, layer):
        return None

    def process_weights_after_loading(self, layer) -> None:
        self.session.check()  # already done before the weights were read (loading.py); a no-op then

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts_input=None, shared_experts=None):
        raise RuntimeError(f"{layer.layer_name}: its routed experts are computed by expertd; "
                           "ExpertdMoERunner.forward sends the layer to the server instead")


class ExpertdRoutedExperts(RoutedExperts):
    """vLLM's RoutedExperts; with an expertd target, without weights (``ExpertdMoEMethod``)."""

    def _get_quant_method(self, prefix, quant_config, moe_config):
        session = session_for(get_current_vllm_config())
        if session is None:
            return super()._get_quant_method(prefix, quant_config, moe_config)
        return ExpertdMoEMethod(moe_config, session)

    @property
    def expertd_session(self) -> ExpertdSession | None:
        method = self.quant_method
        return method.session if isinstance(method, ExpertdMoEMethod) else None

    def load_weights(self, weights):
        if self.expertd_session is None:
            yield from super().load_weights(weights)
            return
        for name, _ in weights:  # the loader filters them out before reading (loading.py); never expected here
            raise RuntimeError(f"{self.layer_name}: checkpoint tensor {name!r} of routed experts computed by expertd "
                               "reached the layer; the expertd loader filter should have skipped it")


class ExpertdMoERunner(MoERunner):
    """vLLM's MoERunner; with an expertd target, its forward is one Forward of the layer on the server."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        routed = self.routed_experts
        self.expertd_session: ExpertdSession | None = getattr(routed, "expertd_session", None)
        if self.expertd_session is None:
            return
        unsupported = _unsupported(self)
        if unsupported:
            raise ValueError(f"{self.layer_name}: expertd cannot compute this MoE layer as vLLM does ({unsupported})")
        self.expertd_layer = int(self.layer_id)
        self.expertd_session.add_layer(self.expertd_layer, self.layer_name)

    def forward(self, hidden_states, router_logits, input_ids=None, shared_experts_input=None):
        if self.expertd_session is None:
            return super().forward(hidden_states, router_logits, input_ids, shared_experts_input)
        return torch.ops.vllm.expertd_moe_forward(hidden_states, self.layer_name)

    def expertd_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        out = self.expertd_session.forward(hidden_states.reshape(-1, shape[-1]), self.expertd_layer)
        if (self.routed_scaling_factor != 1.0 and out.dtype == torch.float16 and self._shared_experts is not None):
            # vLLM's float16 DeepSeek layers carry the residual stream divided by the routed scaling
            # factor, and the MoE layer returns shared / s + routed; the server answers shared + s * routed.
            out = out * (1.0 / self.routed_scaling_factor)
        return out.reshape(shape)


def _unsupported(runner: MoERunner) -> str:
    config = runner.moe_config
    if config.tp_size > 1 or config.ep_size > 1 or config.dp_size > 1 or config.is_sequence_parallel:
        return (f"tensor/expert/data parallel MoE (tp={config.tp_size}, ep={config.ep_size}, dp={config.dp_size}) "
                "is not supported yet: run the attention side with one rank")
    if runner.routed_input_transform is not None or runner.routed_output_transform is not None:
        return "a latent MoE (routed input/output transforms)"
    if _uses_cudagraphs(get_current_vllm_config()):
        return "CUDA graphs would capture the expert server call: run with enforce_eager=True"
    return ""


def _uses_cudagraphs(vllm_config) -> bool:
    from vllm.config import CUDAGraphMode
    from vllm.platforms import current_platform
    mode = vllm_config.compilation_config.cudagraph_mode
    return not current_platform.is_cpu() and mode is not None and mode != CUDAGraphMode.NONE


def _expertd_moe_forward(hidden_states: torch.Tensor, layer_name: str) -> torch.Tensor:
    runner = get_forward_context().no_compile_layers[layer_name]
    return runner.expertd_forward(hidden_states)


def _expertd_moe_forward_fake(hidden_states: torch.Tensor, layer_name: str) -> torch.Tensor:
    return torch.empty_like(hidden_states)


_INSTALLED = False


def install() -> None:
    """Register the custom op and the out-of-tree layer classes (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    direct_register_custom_op(op_name="expertd_moe_forward", op_func=_expertd_moe_forward,
                              fake_impl=_expertd_moe_forward_fake)
    RoutedExperts.register_oot(ExpertdRoutedExperts)
    MoERunner.register_oot(ExpertdMoERunner)
    _INSTALLED = True
