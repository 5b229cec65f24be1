"""The device-worker side of the batcher: one padded engine step, and the start-up calibration.

Both run on the thread that owns the engine (the batcher's device-worker thread, or the event loop
for the batcher's idle fast path); nothing here touches asyncio. Shapes: B the bucket, H hidden,
E routed experts, k top-k.
"""
from __future__ import annotations

import time

import numpy as np

from expertd.server.batching.admission import StepTimes
from expertd.server.engine import api
from expertd.server.engine.api import ModelDescription


def run_step(engine, layer: int, kind: str, parts: list[np.ndarray], bucket: int, rows: int, token_ids=None):
    """``parts`` (row ranges in the engine dtype, ``rows`` in all) padded to ``bucket`` rows and run
    as one engine step of ``kind`` (``api.FORWARD``, ``ROUTE_HIDDEN`` or ``ROUTE_LOGITS``);
    ``token_ids`` int32 [bucket] for hash-routed layers, else None.
    -> (the engine's result, its seconds, per-row flags bool [rows] of non-finite results or None)."""
    started = time.perf_counter()
    tokens = api.pad_rows(parts, bucket)
    if kind == api.FORWARD:
        result = engine.forward(layer, tokens, rows, token_ids=token_ids)
        checked = (result.output, result.topk_weights)
    else:
        result = engine.route(layer, tokens, rows, from_logits=kind == api.ROUTE_LOGITS, token_ids=token_ids)
        checked = (result.topk_weights, result.aux_scores)
    seconds = time.perf_counter() - started
    if all(np.isfinite(array).all() for array in checked):
        return result, seconds, None
    return result, seconds, np.logical_or.reduce([~np.isfinite(array).all(axis=1) for array in checked])


def calibrate(engine, model: ModelDescription, times: StepTimes, max_rows: int, step_key) -> None:
    """Seed ``times`` with each (layer config, step kind, bucket up to ``max_rows``) step's seconds,
    under ``step_key(cfg, kind)``: run on random tokens, the second run measured (the first may
    still pay for first use)."""
    rng, seen = np.random.default_rng(0), set()
    largest = model.bucket_for(max_rows)
    for layer, cfg in model.layers.items():
        if cfg in seen:
            continue
        seen.add(cfg)
        for kind in api.STEP_KINDS:
            logits = kind == api.ROUTE_LOGITS
            width, dtype = (cfg.num_experts, np.float32) if logits else (cfg.hidden_size, model.dtype)
            for bucket in (b for b in model.buckets if b <= largest):
                tokens = api.cast(rng.standard_normal((bucket, width), np.float32), dtype)
                ids = np.zeros(bucket, np.int32) if cfg.hash_routed else None  # any id is in the vocabulary
                run_step(engine, layer, kind, [tokens], bucket, bucket, ids)
                times.seed(step_key(cfg, kind), bucket, run_step(engine, layer, kind, [tokens], bucket, bucket, ids)[1])
