"""The MoE layer cases the kernel benchmarks time (moe_layer.py's, shared by host_allocator.py,
layer_timeline.py, parallel_for_trace.py and pallas_tiles.py): the shapes, a layer's config for one,
the layer as the engine serves it, and the cases a command line selects."""
from __future__ import annotations

LAYER_SHAPES = ((8, 2, 1024, 2048, "mixtral"), (64, 8, 1024, 512, "qwen3_moe"))
"""(E, k, H, I, family): a Mixtral-style layer and a Qwen3-MoE-style one."""
LAYER_DTYPES = ("bfloat16", "float32")


def layer_config(e: int, k: int, h: int, i: int, family: str):
    """The MoEConfig of one shape, through the family's Hugging Face config (mixtral or qwen3_moe)."""
    from expertd.server.models.hf_config import moe_config_from_hf

    if family == "mixtral":
        return moe_config_from_hf(dict(model_type="mixtral", hidden_size=h, intermediate_size=i,
                                       num_local_experts=e, num_experts_per_tok=k))
    return moe_config_from_hf(dict(model_type="qwen3_moe", hidden_size=h, moe_intermediate_size=i,
                                   num_experts=e, num_experts_per_tok=k, norm_topk_prob=True))


def served_case(e: int, k: int, h: int, i: int, family: str, t: int, dtype):
    """One shape as a library user (and the engine) runs it: (cfg, params, served, auto_backend, x).
    ``params`` are the seeded params as loaded; ``served`` = ``moe.prepare_params(params, cfg)``, the
    ones ``auto`` runs on (the native CPU kernel's layout where it runs, else ``params`` itself);
    both on huge pages as the engine places them. x: ``[t, h]`` random tokens in ``dtype``."""
    import jax
    import jax.numpy as jnp

    from expertd.kernels import experts, moe
    from expertd.server.host import memory

    cfg = layer_config(e, k, h, i, family)
    params = moe.init_params(cfg, jax.random.key(0), dtype)
    memory.advise_huge_pages(jax.tree.leaves(params))
    auto_backend = experts.choose_backend(t * k, e, h, i, dtype)
    served = moe.prepare_params(params, cfg)
    if served is not params:
        memory.advise_huge_pages(jax.tree.leaves(served))
    x = jax.random.normal(jax.random.key(1), (t, h), jnp.float32).astype(dtype)
    return cfg, params, served, auto_backend, x


def selected_cases(args, shapes, default_tokens):
    """(shape, dtype name, T) for every shape whose E is in ``args.experts``, every dtype of
    ``args.dtypes`` and token count of ``args.tokens`` (or ``default_tokens`` where it is empty)."""
    for shape in shapes:
        if shape[0] not in args.experts:
            continue
        for dtype_name in args.dtypes:
            for t in args.tokens or default_tokens:
                yield shape, dtype_name, t
