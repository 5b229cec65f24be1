"""Compiling the kernels tests' programs fast: XLA's backend optimisation off (the programs are
tiny, so it is wasted time), and many programs compiled on two threads."""
from concurrent.futures import ThreadPoolExecutor

import jax

# Test programs are tiny, so XLA's backend optimisation is wasted time: compile at level 0.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def compile_fast(fn, *args):
    """jit-compile fn for args with FAST_COMPILE; returns the compiled executable."""
    return jax.jit(fn).lower(*args).compile(compiler_options=FAST_COMPILE)


def compile_all(build, points):
    """{point: build(point)} built on two threads (XLA compiles outside the GIL)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(points, pool.map(build, points)))
