"""The NaN / Inf scan of a request's hidden states (`decode.check_tokens`): per request, on the loop.

Every Forward's hidden states are scanned for NaN / Inf once, on the event loop for all but large
requests. For bfloat16 and float16 the scan tests the exponent bits as integers; this times that
against numpy's `isfinite` (ml_dtypes' loop for bfloat16) on the same arrays, interleaved round by
round, for decode-sized and large requests (DeepSeek's H = 7168, and the overload benchmark's
8,192 x 512). Reports the median over rounds of the mean microseconds per request, and the ratio.

    .venv/bin/python benchmarks/token_checks.py [--rounds 20]

Writes benchmarks/results/token_checks.json.
"""
from __future__ import annotations

import argparse
import os
import time

import harness
import ml_dtypes
import numpy as np

from expertd.server.frontends import decode

RESULTS = os.path.join(harness.RESULTS, "token_checks.json")
SHAPES = [(1, 7168), (16, 7168), (256, 7168), (8192, 512)]
DTYPES = [ml_dtypes.bfloat16, np.float16]


def isfinite_scan(x: np.ndarray) -> bool:
    return bool(np.isfinite(x).all())


def bits_scan(x: np.ndarray) -> bool:
    """The served check (``decode.check_tokens``: shape, then the exponent-bit scan)."""
    decode.check_tokens(x, "hidden_states", x.shape[1], "H", len(x))
    return True


def mean_us(fn, x, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn(x)
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    rows = []
    print(f"{'dtype':>9} {'T':>5} {'H':>5} {'isfinite us':>12} {'bits us':>8} {'bits / isfinite':>16}")
    for dtype in DTYPES:
        for tokens, hidden in SHAPES:
            x = np.random.default_rng(0).standard_normal((tokens, hidden)).astype(dtype)
            assert isfinite_scan(x) and bits_scan(x)
            repeats = max(1, 2_000_000 // x.size)
            samples = {"isfinite": [], "bits": []}
            for _ in range(args.rounds):
                samples["isfinite"].append(mean_us(isfinite_scan, x, repeats))
                samples["bits"].append(mean_us(bits_scan, x, repeats))
            isfinite_us, bits_us = (float(np.median(samples[k])) for k in ("isfinite", "bits"))
            rows.append({"dtype": np.dtype(dtype).name, "tokens": tokens, "hidden": hidden, "isfinite_us": isfinite_us,
                         "bits_us": bits_us, "ratio": bits_us / isfinite_us})
            print(f"{np.dtype(dtype).name:>9} {tokens:>5} {hidden:>5} {isfinite_us:>12.1f} {bits_us:>8.1f} "
                  f"{bits_us / isfinite_us:>16.2f}")
    harness.write_results(args.out, "token_checks", rows, rounds=args.rounds)


if __name__ == "__main__":
    main()
