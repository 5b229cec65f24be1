"""Compilation at start-up: JAX's persistent compilation cache, and warm-up (every step compiled
before the server says SERVING)."""
from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Callable

import jax
from jax.experimental.compilation_cache import compilation_cache

from expertd.server.engine import api
from expertd.server.engine.engine import CompileEvent, Engine, timed_compile


def enable_compile_cache(directory) -> None:
    """Turn on JAX's persistent compilation cache in ``directory`` for this process.

    The thresholds are lowered so that it also stores the small, fast CPU compilations (by default
    JAX skips anything compiled in under a second); ``reset_cache`` makes a process that already
    compiled something pick up the new directory.
    """
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    compilation_cache.reset_cache()


def warm_up(engine: Engine, progress: Callable[[CompileEvent], None] | None = None, *,
            threads: int | None = None) -> None:
    """Compile every (layer shape, bucket, step kind) of ``engine``; ``progress(event)`` after each.

    Steps are traced one after the other (in plan order, identical on every process of a
    multi-host mesh) and compiled by ``threads`` worker threads (default: one per CPU core; XLA
    compiles outside the GIL), so the engine's ``compile_seconds`` can exceed the wall time.
    Steps already compiled are counted as done. Sets ``engine.warm``.
    """
    groups = engine.shape_groups()
    plan = [(key, bucket, kind) for key in groups for bucket in engine.buckets for kind in api.STEP_KINDS]
    todo = [item for item in plan if not engine.is_compiled(*item)]
    done = len(plan) - len(todo)
    pending: dict[concurrent.futures.Future, tuple] = {}

    def finish(futures):
        nonlocal done
        for future in futures:
            key, bucket, kind = pending.pop(future)
            executable, seconds = future.result()
            done += 1
            event = engine.record(key, groups[key], bucket, kind, executable, seconds, done, len(plan))
            if progress is not None:
                progress(event)

    with engine.lock, concurrent.futures.ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
        for key, bucket, kind in todo:
            start = time.perf_counter()
            lowered = engine.lower(key, groups[key], bucket, kind)
            pending[pool.submit(timed_compile, lowered, time.perf_counter() - start)] = (key, bucket, kind)
            finish([f for f in pending if f.done()])  # report what finished while tracing
        finish(list(concurrent.futures.as_completed(pending)))
        engine.warm = True
