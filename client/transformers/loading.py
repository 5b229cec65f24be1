"""``load_without_experts``: load a transformers model with no sparse-MoE weights at all.

transformers 5.x builds a model on the meta device and then materialises what the checkpoint
holds. While ``from_pretrained`` runs here, the family's block class in its modelling module is
replaced by an :class:`ExpertsElsewhere` placeholder that has no parameters, so the router, routed
and shared expert tensors are never allocated nor read: the checkpoint reports them as unused
("unexpected") keys. Everything else (attention, norms, embeddings, dense MLP layers, tied weights,
rotary buffers, dtype) loads as ``from_pretrained`` always does. ``offload_moe`` then replaces each
placeholder with a RemoteMoeBlock.

The substitution is a module-level change of transformers' modelling module for the duration of the
call: do not build models of the same family in other threads meanwhile.
"""
from __future__ import annotations

import contextlib
import sys

from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from expertd.client.transformers.families import FAMILIES, Family


class ExpertsElsewhere(nn.Module):
    """A sparse-MoE block loaded without its weights: no parameters; ``offload_moe`` replaces it."""

    expertd_family: Family

    def __init__(self, *args, **kwargs):  # the block's constructor arguments (config, layer index) are not needed
        super().__init__()

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"this {self.expertd_family.block} was loaded without its experts: call "
                           "expertd.client.transformers.offload_moe(model, target) before running the model")

    def extra_repr(self) -> str:
        return f"family={self.expertd_family.model_type}"


def load_without_experts(pretrained, *, model_class=None, **from_pretrained_kwargs) -> nn.Module:
    """``model_class.from_pretrained(pretrained, **from_pretrained_kwargs)`` without the MoE blocks' weights.

    Args:
      pretrained: a checkpoint directory or Hub id, as for ``from_pretrained``.
      model_class: a transformers model class or auto class (default ``AutoModelForCausalLM``).
      from_pretrained_kwargs: passed on (``dtype``, ``config``, ``revision``, ...).

    Returns:
      The model, each sparse-MoE block an ExpertsElsewhere placeholder (no parameters) until
      ``offload_moe`` replaces it. ValueError when the model's family has no block in ``FAMILIES``.
    """
    model_class = model_class or AutoModelForCausalLM
    config = from_pretrained_kwargs.pop("config", None) or AutoConfig.from_pretrained(pretrained)
    concrete = model_class._model_mapping[type(config)] if hasattr(model_class, "_model_mapping") else model_class
    modelling = sys.modules[concrete.__module__]
    blocks = [name for name in FAMILIES if isinstance(getattr(modelling, name, None), type)]
    if not blocks:
        raise ValueError(f"{concrete.__name__} ({modelling.__name__}) has no sparse-MoE block of a known family; "
                         f"known blocks: {', '.join(sorted(FAMILIES))}")
    with _placeholders(modelling, blocks):
        return model_class.from_pretrained(pretrained, config=config, **from_pretrained_kwargs)


@contextlib.contextmanager
def _placeholders(modelling, names: list[str]):
    """Replace the block classes ``names`` of the modelling module by placeholders, then restore them."""
    originals = {name: getattr(modelling, name) for name in names}
    try:
        for name in names:
            setattr(modelling, name, type(name, (ExpertsElsewhere,), {"expertd_family": FAMILIES[name],
                                                                      "__module__": __name__}))
        yield
    finally:
        for name, original in originals.items():
            setattr(modelling, name, original)
