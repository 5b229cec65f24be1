"""The kernels' names that settings are checked against, defined once and JAX-free.

A server's config validates its flags against these without importing JAX or the kernels
(`import expertd.kernels.names` loads neither); the kernels import them from here.

  EXPERT_BACKENDS         the grouped expert FFN's backends (`experts.BACKENDS`; "auto" chooses
                          one of them per platform and shape, `experts.choose_backend`)
  NATIVE_CPU_ISA_LEVELS   the native CPU kernels' instruction-set levels, lowest first
                          (`cpu.ISA_LEVELS`, `cpu.BuildOptions.isa_cap`; csrc/simd.h Isa)
  EXPERT_WEIGHTS          what the routed expert weights are served as (`cpu.EXPERT_WEIGHTS_CHOICES`,
                          `moe.prepare_params(expert_weights=...)`): "dtype" (as loaded) or "int8"
"""
from __future__ import annotations

EXPERT_BACKENDS = ("reference", "ragged_dot", "capacity", "expert_loop", "native_cpu", "pallas", "tokamax")
NATIVE_CPU_ISA_LEVELS = ("portable", "avx2", "avx512", "avx512_bf16", "amx_bf16")
EXPERT_WEIGHTS = ("dtype", "int8")

__all__ = ["EXPERT_BACKENDS", "EXPERT_WEIGHTS", "NATIVE_CPU_ISA_LEVELS"]
