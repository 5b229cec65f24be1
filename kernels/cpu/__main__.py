"""`python -m expertd.kernels.cpu [--cache-dir DIR] [--compiler CXX] [--trace]`: build the native CPU
library ahead of time (e.g. into a container image) and print where it is and the level it runs at."""
from __future__ import annotations

import argparse

from expertd.kernels import cpu
from expertd.kernels.cpu import build


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", help=f"where to put the library (default {build.DEFAULT_CACHE_DIR})")
    parser.add_argument("--compiler", help=f"the C++ compiler (default: the first of {build.COMPILERS} on PATH)")
    parser.add_argument("--trace", action="store_true", help="the trace build (ParallelFor records)")
    args = parser.parse_args(argv)
    cpu.configure(cpu.BuildOptions(cache_dir=args.cache_dir, compiler=args.compiler, trace=args.trace))
    if not cpu.available():
        raise SystemExit(f"native CPU kernel unavailable: {cpu.unavailable_reason()}")
    print(f"{build.library_path()} (instruction set: {cpu.isa()})")


if __name__ == "__main__":
    main()
