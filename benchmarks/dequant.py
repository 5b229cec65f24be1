"""FP8 block dequantisation, one DeepSeek-V3 expert matrix at a time: the codec's three paths.

`quant.dequantize_fp8_block` on a `[2048, 7168]` float8 e4m3 matrix with 128x128 float32 block
scales (a DeepSeek-V3 expert's gate / up projection) into bfloat16, three ways, interleaved round by
round in one process so the machine's drift hits both alike:

  tables     the default for blocks of 1024 elements or more: one 256-entry table per block
             (code -> value x scale, rounded once), each code looked up by the native CPU
             library (`kernels.cpu.block_lookup`)
  numpy      the same tables without the native library: `np.take` a chunk of rows at a time
  per-chunk  forced by raising `fp8_tables.MIN_BLOCK_ELEMENTS`: code -> float32, times the
             block scale, finite check, cast (the path every other format's layout takes)

each timed on one thread (one matrix) and on two threads at once (two matrices, as the loader's
workers run them). Reports the median ms per matrix and the ratios to per-chunk. The paths give
the same bits (checked here; tests/server/models/test_quant.py checks them over a grid).

    .venv/bin/python benchmarks/dequant.py [--rounds 10] [--threads 2]

Writes benchmarks/results/dequant.json.
"""
from __future__ import annotations

import argparse
import os
import threading
import time

import harness
import ml_dtypes
import numpy as np

from expertd.server.models.quant import codecs, fp8_tables

ROWS, COLS, BLOCK = 2048, 7168, 128
RESULTS = os.path.join(harness.RESULTS, "dequant.json")
PATHS = {"tables": (fp8_tables.MIN_BLOCK_ELEMENTS, True), "numpy": (fp8_tables.MIN_BLOCK_ELEMENTS, False),
         "per-chunk": (1 << 40, False)}
NATIVE = fp8_tables.cpu


class _WithoutNative:
    """`kernels.cpu` as fp8_tables sees it when the native library is unavailable."""

    @staticmethod
    def block_lookup(*args) -> bool:
        return False


def use(path: str) -> None:
    fp8_tables.MIN_BLOCK_ELEMENTS, native = PATHS[path]
    fp8_tables.cpu = NATIVE if native else _WithoutNative


def matrix(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (ROWS, COLS), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaN codes
    scales = rng.uniform(1e-4, 1e-2, (ROWS // BLOCK, COLS // BLOCK)).astype(np.float32)
    return codes.view(codecs.E4M3), scales


def dequantize(weight, scales) -> np.ndarray:
    return codecs.dequantize_fp8_block(weight, scales, (BLOCK, BLOCK), out_dtype=ml_dtypes.bfloat16)


def timed(matrices) -> float:
    """Seconds to dequantise `matrices`, each on its own thread (one: this thread)."""
    if len(matrices) == 1:
        start = time.perf_counter()
        dequantize(*matrices[0])
        return time.perf_counter() - start
    threads = [threading.Thread(target=dequantize, args=m) for m in matrices]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2, help="matrices dequantised at once in the threaded case")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    matrices = [matrix(seed) for seed in range(max(1, args.threads))]
    outputs = {}
    for path in PATHS:
        use(path)
        outputs[path] = dequantize(*matrices[0]).view(np.uint16)  # also warms each path up
    assert all(np.array_equal(outputs["per-chunk"], out) for out in outputs.values()), "the paths disagree"
    times = {(path, n): [] for path in PATHS for n in (1, args.threads)}
    for _ in range(args.rounds):
        for (path, n), samples in times.items():
            use(path)
            samples.append(timed(matrices[:n]) / n)
    use("tables")
    rows = []
    print(f"{'threads':>8} {'tables ms':>10} {'numpy ms':>9} {'per-chunk ms':>13} {'tables / per-chunk':>19} "
          f"{'numpy / per-chunk':>18}   (median per matrix)")
    for n in sorted({1, args.threads}):
        tables, numpy_tables, per_chunk = (float(np.median(times[(path, n)])) * 1e3 for path in PATHS)
        rows.append({"threads": n, "tables_ms": tables, "numpy_tables_ms": numpy_tables, "per_chunk_ms": per_chunk,
                     "ratio": tables / per_chunk, "numpy_ratio": numpy_tables / per_chunk,
                     **{f"{path.replace('-', '_')}_samples_ms": [t * 1e3 for t in times[(path, n)]]
                        for path in PATHS}})
        print(f"{n:>8} {tables:>10.1f} {numpy_tables:>9.1f} {per_chunk:>13.1f} {tables / per_chunk:>19.2f} "
              f"{numpy_tables / per_chunk:>18.2f}")
    harness.write_results(args.out, "dequant", rows, shape=[ROWS, COLS], block=[BLOCK, BLOCK], rounds=args.rounds)


if __name__ == "__main__":
    main()
