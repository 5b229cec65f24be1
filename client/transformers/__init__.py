"""expertd.client.transformers: run a transformers model's sparse-MoE blocks on an expert server
(the optional extra ``expertd[transformers]``: torch and transformers >= 5.24).

    from transformers import AutoModelForCausalLM
    from expertd.client.transformers import offload_moe

    model = AutoModelForCausalLM.from_pretrained("path/to/checkpoint")
    with offload_moe(model, "localhost:8001", keep_local=False):   # checks the server's layers first
        tokens = model.generate(input_ids, max_new_tokens=32)

    # or never load the expert weights at all:
    model = load_without_experts("path/to/checkpoint")
    offload = offload_moe(model, "localhost:8001")

Modules: ``families`` (the block classes per family and what the server must hold), ``remote``
(RemoteMoeBlock and the torch <-> numpy conversions), ``offload`` (offload_moe, the start check),
``loading`` (load_without_experts). docs/attention.md describes what each family's block returns.
"""
try:
    import torch  # noqa: F401 - the extra's dependencies, checked once with a clear message
    import transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("expertd.client.transformers needs torch and transformers >= 5.24: "
                      "pip install 'expertd[transformers]'") from exc

from expertd.client.transformers.families import FAMILIES, Family, LayerSpec, expected_layer, find_moe_blocks
from expertd.client.transformers.loading import ExpertsElsewhere, load_without_experts
from expertd.client.transformers.offload import LayerMismatchError, Offload, check_layers, offload_moe
from expertd.client.transformers.remote import RemoteMoeBlock, from_wire, to_wire

__all__ = [
    "FAMILIES",
    "ExpertsElsewhere",
    "Family",
    "LayerMismatchError",
    "LayerSpec",
    "Offload",
    "RemoteMoeBlock",
    "check_layers",
    "expected_layer",
    "find_moe_blocks",
    "from_wire",
    "load_without_experts",
    "offload_moe",
    "to_wire",
]
