"""The models the benchmarks serve and their steps: serving.py's ``tiny`` and ``mid`` layers, seeded
layers of any Hugging Face MoE config, an engine built and warmed like the server's, a step padded
to its bucket as the batcher pads it."""
from __future__ import annotations

MID_HF_CONFIG = {  # a mid-size layer that still runs in milliseconds on a CPU
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 512,
    "intermediate_size": 1024, "moe_intermediate_size": 256, "num_hidden_layers": 1, "num_experts": 16,
    "num_experts_per_tok": 4, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "hidden_act": "silu",
}
"""``mid``: one Qwen3-MoE-style layer, H=512, I=256, E=16, k=4."""
SERVED_BUCKETS = (1, 16, 64, 256)
"""The token buckets serving.py, python_floor.py and batch_shapes.py serve with."""


def tiny_layers():
    """The ``tiny`` preset's first layer in float32."""
    from expertd.server.models.presets import load_preset

    return load_preset("tiny", num_layers=1, dtype="float32")


def seeded_layers(hf_config: dict, dtype: str = "float32", num_layers: int = 1, source: str = "benchmark"):
    """``num_layers`` layers of ``hf_config``'s MoE shape with seeded weights (seed 0) in ``dtype``."""
    from expertd.server.models.hf_config import moe_config_from_hf
    from expertd.server.models.presets import LoadedLayer, SeededParams

    cfg = moe_config_from_hf(hf_config)
    return [LoadedLayer(i, cfg, SeededParams(cfg, layer_index=i, seed=0, dtype=dtype), source=source)
            for i in range(num_layers)]


def benchmark_layers(model: str):
    """serving.py's models by name: ``tiny`` or ``mid`` (float32)."""
    if model == "tiny":
        return tiny_layers()
    if model == "mid":
        return seeded_layers(MID_HF_CONFIG, source="benchmark mid")
    raise ValueError(f"model: expected tiny or mid, got {model!r}")


def tiny_engine(buckets=SERVED_BUCKETS):
    """(engine, hidden size): the ``tiny`` layer on one device in float32, every bucket compiled."""
    import numpy as np

    from expertd.server.engine.build import build_engine

    engine = build_engine(tiny_layers(), buckets=buckets, dtype="float32", devices=1).engine
    hidden = engine.layers[0].cfg.hidden_size
    for bucket in buckets:
        engine.forward(0, np.zeros((bucket, hidden), np.float32), 1)
    return engine, hidden


def bucket_for(buckets, rows: int) -> int:
    """The smallest bucket that holds ``rows``."""
    return next(b for b in buckets if b >= rows)


def padded_forward(engine, layer: int, parts: list):
    """``layer``'s forward step on the rows of ``parts`` (each [T_i, H]) as the batcher runs it:
    padded to the smallest of the engine's buckets that holds them (``api.pad_rows``)."""
    from expertd.server.engine.api import pad_rows

    rows = sum(len(x) for x in parts)
    return engine.forward(layer, pad_rows(parts, bucket_for(engine.buckets, rows)), rows)
