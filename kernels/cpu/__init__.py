"""expertd.kernels.cpu: the native CPU backend behind one door.

A C++ library of XLA:CPU custom calls (csrc/, see its README.md): a grouped matmul that reads each
used expert's weights once, in place (bf16 widened in registers), or runs a register-blocked GEMM
for many rows, on AVX-512 / AVX2 / portable paths chosen at run time; and the layer's dispatch
passes (layout as a counting sort, combine). Built on first use with the system compiler.

What the rest of expertd may use is imported here; the modules behind it:

  build     BuildOptions, configure(options): cache folder, compiler, trace build, instruction-set
            cap, passed in explicitly (the server's config reads its flags and calls configure
            once, before the first use); available(), unavailable_reason(); ISA_LEVELS
  library   isa(): the instruction-set level the kernels run at
  ffi       grouped_matmul, grouped_glu (gate, up and the gated activation in one call; fuses(),
            FUSED_ACTIVATIONS), layout, combine: the custom calls, with grouped_matmul_reference and
            grouped_glu_reference beside them (layout's and combine's twins are dispatch.layout /
            dispatch.unpermute)
  panels    the panel-major weight layout (PanelWeights, to_panels, panel_columns, PANEL_WIDTHS)
  numa      the NUMA placement plan: nodes from sysfs, each node's share of every expert's
            intermediate columns, summary, thread pinning and mbind; tested against faked
            topologies, reported at start-up, not yet applied (XLA's intra-op pool, which runs
            the kernel, cannot be pinned per node)
  int8      INT8 expert weights (W8A16): quantize with its numpy twin, to_int8_panels (int8 panels
            with per-output-column scales, which grouped_matmul reads), the matmul's numpy reference;
            Int8FromFp8 / fp8_to_int8_panels: block-scaled FP8 codes straight to those panels
  host_copy copy_2d: a 2-D copy from a strided (transposed) view, the checkpoint loader's transpose;
            block_lookup: 8-bit codes decoded through per-block tables (FP8 block-scaled weights)
  policy    which backend "auto" runs on CPU and the XLA:CPU options it compiles with
  layer     grouped_ffn (the "native_cpu" backend), routed_experts (the layer's CPU pass),
            prepare_params (expert_weights "dtype" or "int8": EXPERT_WEIGHTS_CHOICES),
            dense_weights, describe

Not behind this door: `diagnostics`, the tests' and benchmarks' look inside the library and their
knobs (path_items, parallel_for_trace, caller_only_work, limit_isa, supported_isas, vectorized,
build_log, options): `from expertd.kernels.cpu import diagnostics`.

Imports point one way: this package uses the generic pieces it needs (config, params, ffn,
dispatch) and nothing that uses it; `expertd.kernels.experts` and `expertd.kernels.moe` import
this door at the top of their modules (the backend table's "native_cpu" entry, the CPU branch of
`choose_backend`, the layer's CPU pass, `prepare_params`). Outside this package nothing knows what
a panel is: prepared weights are not arrays, and the other backends read them through
`dense_weights`.
"""
from expertd.kernels.cpu import int8, numa
from expertd.kernels.cpu.build import ISA_LEVELS, BuildOptions, available, configure, unavailable_reason
from expertd.kernels.cpu.ffi import (
    FUSED_ACTIVATIONS,
    combine,
    fuses,
    grouped_glu,
    grouped_glu_reference,
    grouped_matmul,
    grouped_matmul_reference,
    layout,
)
from expertd.kernels.cpu.host_copy import (
    block_lookup,
    block_lookup_reference,
    copy_2d,
    copy_2d_numpy,
    copy_2d_reference,
)
from expertd.kernels.cpu.layer import (
    EXPERT_WEIGHTS_CHOICES,
    PREPARING_BACKENDS,
    dense_weights,
    describe,
    grouped_ffn,
    prepare_params,
    routed_experts,
)
from expertd.kernels.cpu.library import AMX_ORDERS, amx, isa
from expertd.kernels.cpu.panels import PANEL_WIDTHS, PanelWeights, panel_columns, to_panels
from expertd.kernels.cpu.policy import choose_backend, compiler_options

__all__ = [
    "AMX_ORDERS", "BuildOptions", "EXPERT_WEIGHTS_CHOICES", "FUSED_ACTIVATIONS", "ISA_LEVELS", "PANEL_WIDTHS",
    "PREPARING_BACKENDS", "PanelWeights", "amx", "available", "block_lookup", "block_lookup_reference",
    "choose_backend", "combine", "compiler_options", "configure", "copy_2d", "copy_2d_numpy", "copy_2d_reference",
    "dense_weights", "describe", "fuses", "grouped_ffn", "grouped_glu", "grouped_glu_reference", "grouped_matmul",
    "grouped_matmul_reference", "int8", "isa", "layout", "numa", "panel_columns", "prepare_params", "routed_experts",
    "to_panels", "unavailable_reason",
]
