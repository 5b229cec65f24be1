"""The native CPU grouped matmul (kernels/cpu/csrc/grouped_matmul_cpu.cc) on its own, per projection.

For each (E, K, C) projection shape, rows per expert and weight dtype: `cpu.grouped_matmul`
against, in the same run, XLA's batched dot of the same products (`einsum("emk,ekc->emc")` with
uniform groups: what the "capacity" backend runs, no padding) and the memory floor (the weight
bytes / this machine's copy bandwidth, read + write, as in moe_layer.py's (c)); "of read" is the
fraction of this machine's read bandwidth the kernel streams its weights at (moe_layer.py's (c')),
the ceiling for few rows per expert. Each call reads another copy of the weights, enough copies to
pass 4x 32 MiB, so no shape runs out of the last-level cache. XLA is timed in a loop of its own
after the kernel, not interleaved with it: its bf16 einsum writes a widened fp32 copy of the
weights, which slows the kernel call after it. Reports median ms, GB/s of
weights, GFLOP/s, and the ratios; writes benchmarks/results/native_cpu_kernel.json.

The weights are moved onto huge pages, as the engine places them (expertd.server.host.memory);
`--pages-ab` also times the kernel on copies left on 4 KiB pages, interleaved ("2M/4k" > 1: huge
pages faster). "pan ms" / "pan/rm" time the same call on the weights panel-major
(`cpu.to_panels`, as `moe.prepare_params` lays them out on CPU), interleaved with the row-major call
("pan/rm" > 1: panels faster).

The rows are bf16 values where the weights are bf16 (x rounded to the weights' dtype, as the layer's
rows are), so AVX512_BF16 CPUs run the panels on the bf16 dot product. `--isa-ab` also times the
panel-major call at every lower instruction-set level this CPU runs (diagnostics.limit_isa), each on
the panel width the engine makes for that level, interleaved: "<level>/top" > 1 means the top level
is faster. `--width-ab` also times the panel-major call on the other panel width (16 or 64 columns,
`cpu.to_panels`), interleaved: "pan/W<other>" > 1 means the width prepare_params picks for this
CPU is faster. The "path" column names the kernel
path the panel-major call took (diagnostics.path_items).

`--variant other.cc` also builds a modified copy of the kernel source and times it interleaved
with the committed one (the A/B that picked the kernel's parameters): "variant/base" > 1 means the
variant is faster; with `--variant-on-panels` both run on panel-major weights. Run under
`flock /tmp/expertd-bench.lock` when other jobs share the machine.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

import harness
import jax
import jax.numpy as jnp
import numpy as np

from expertd.kernels import cpu
from expertd.kernels.cpu import build, diagnostics
from expertd.server.host import allocator, memory

# Projections of the two moe_layer.py shapes: Mixtral-style E=8 [1024, 2048] (gate / up) and
# [2048, 1024] (down); Qwen3-MoE-style E=64 [1024, 512] and [512, 1024].
SHAPES = ((8, 1024, 2048), (8, 2048, 1024), (64, 1024, 512), (64, 512, 1024))
ROWS_PER_EXPERT = (1, 2, 4, 8, 16, 32, 64, 256)
DTYPES = ("bfloat16", "float32")
CYCLE_BYTES = 128 << 20
RESULTS = os.path.join(harness.RESULTS, "native_cpu_kernel.json")


def variant_call(source: pathlib.Path, on_panels: bool = False):
    """Build `source` (a variant of the kernel) and return a jitted call of it like grouped_matmul,
    through its entry point for row-major or (`on_panels`) panel-major weights."""
    cxx = build.find_compiler()
    if cxx is None:
        sys.exit("no C++ compiler for --variant")
    target = pathlib.Path(tempfile.mkdtemp(prefix="expertd-variant-")) / "variant.so"
    # The kernel's sources name helpers defined in library.cc (the AMX probe): the variant's own copy
    # where its folder has one, else the committed one.
    library_cc = source.parent / "library.cc"
    library_cc = library_cc if library_cc.exists() else build.CSRC_DIR / "library.cc"
    build.compile_library(cxx, target, sources=(source, library_cc))
    symbol = "ExpertdGroupedMatmulPanels" if on_panels else "ExpertdGroupedMatmul"  # older sources lack the first
    build.register(target, {"expertd_grouped_matmul_variant": symbol})

    def call(x, group_sizes, w):
        out = jax.ShapeDtypeStruct((x.shape[0], (w.logical_shape if on_panels else w.shape)[2]), jnp.float32)
        return jax.ffi.ffi_call("expertd_grouped_matmul_variant", out)(x, group_sizes, w.panels if on_panels else w)
    return jax.jit(call)


def weight_copies(w0, dtype):
    """Fresh scaled copies of w0, enough to pass CYCLE_BYTES."""
    return [(w0 * (1 + 1e-3 * j)).astype(dtype) for j in range(max(2, -(-CYCLE_BYTES // w0.nbytes)))]


def at_isa(fn, level):
    """`fn` run with the kernels limited to instruction-set `level`."""
    def call(*args):
        with diagnostics.limit_isa(level):
            return jax.block_until_ready(fn(*args))
    return call


def run_case(e, k, c, m, dtype_name, bandwidth, read_rate, variant=None, reps=15, pages_ab=False,
             variant_on_panels=False, isa_ab=False, width_ab=False):
    dtype = jnp.dtype(dtype_name)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((e * m, k)), dtype).astype(jnp.float32)  # the layer's rows: dtype values
    group_sizes = jnp.full((e,), m, jnp.int32)
    w0 = jnp.asarray(rng.standard_normal((e, k, c)) * 0.02, dtype)
    weights_4k = weight_copies(w0, dtype) if pages_ab else None  # made first: fresh 4 KiB mappings
    weights = weight_copies(w0, dtype)
    memory.advise_huge_pages(weights)  # as the engine places them
    weight_panels = [cpu.to_panels(w) for w in weights]  # the layout prepare_params makes on CPU
    memory.advise_huge_pages(jax.tree.leaves(weight_panels))
    lower_isas = diagnostics.supported_isas()[1:-1] if isa_ab else ()  # AVX2 and up, below the top level
    # Each level on the panel width the engine would make for it (16 columns below AVX-512).
    width_of = {level: cpu.panel_columns(level) for level in lower_isas}
    panels_of_width = {width: [cpu.to_panels(w, width) for w in weights] for width in set(width_of.values())
                       if width != weight_panels[0].panel_columns}
    memory.advise_huge_pages(jax.tree.leaves(panels_of_width))
    fns = {"native": jax.jit(cpu.grouped_matmul), "panels": jax.jit(cpu.grouped_matmul),
           "xla": jax.jit(lambda v, g, w: jnp.einsum("emk,ekc->emc", v.reshape(e, m, k), w.astype(jnp.float32),
                                                     precision=jax.lax.Precision.DEFAULT).reshape(e * m, c))}
    if variant is not None:
        fns["variant"] = variant
    for level in lower_isas:
        fns[f"panels@{level}"] = at_isa(fns["panels"], level)
    weights_of = {name: weights for name in fns}
    on_panels = {"panels"} | {f"panels@{level}" for level in lower_isas}
    if variant_on_panels:
        on_panels.add("variant")
    for name in on_panels:
        weights_of[name] = weight_panels
    for level in lower_isas:
        weights_of[f"panels@{level}"] = panels_of_width.get(width_of[level], weight_panels)
    other_width = 80 - weight_panels[0].panel_columns  # 16 <-> 64
    if width_ab:
        fns["panels_other_width"] = fns["panels"]
        weights_of["panels_other_width"] = [cpu.to_panels(w, other_width) for w in weights]
        memory.advise_huge_pages(jax.tree.leaves(weights_of["panels_other_width"]))
        on_panels.add("panels_other_width")
    if pages_ab:  # the same kernel on copies left on 4 KiB pages
        fns["native_4k"] = fns["native"]
        weights_of["native_4k"] = weights_4k
    want = np.asarray(fns["xla"](x, group_sizes, w0))
    before = diagnostics.path_items()
    jax.block_until_ready(fns["panels"](x, group_sizes, weight_panels[0]))
    path = ",".join(name for name, n in diagnostics.path_items().items() if n > before[name])
    for name, fn in fns.items():  # compile, and check they compute the same product
        got = np.asarray(fn(x, group_sizes, cpu.to_panels(w0) if name in on_panels else w0))
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * np.sqrt(k), err_msg=name)
    times = {name: [] for name in fns}
    for group in ([name for name in fns if name != "xla"], ["xla"]):  # the A/B interleaved, then XLA
        for rep in range(reps):
            for j, name in enumerate(harness.order(group, rep + 1)):  # reversed first
                w = weights_of[name][(rep * len(group) + j) % len(weights)]
                t0 = time.perf_counter()
                jax.block_until_ready(fns[name](x, group_sizes, w))
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(t) for name, t in times.items()}
    row = dict(E=e, K=k, C=c, rows_per_expert=m, dtype=dtype_name, weight_bytes=w0.nbytes, panels_path=path,
               gflop=2 * e * m * k * c / 1e9, floor_s=w0.nbytes / bandwidth, read_floor_s=w0.nbytes / read_rate,
               **{f"{name}_s": s for name, s in med.items()})
    row["vs_xla"] = med["xla"] / med["native"]
    row["panels_vs_row_major"] = med["native"] / med["panels"]
    row["x_floor"] = med["native"] / row["floor_s"]
    row["of_read_rate"] = row["read_floor_s"] / med["native"]
    for level in lower_isas:
        row[f"{level}_vs_top"] = med[f"panels@{level}"] / med["panels"]
    if width_ab:
        row["panel_columns"], row["other_panel_columns"] = weight_panels[0].panel_columns, other_width
        row["width_vs_other"] = med["panels_other_width"] / med["panels"]
    if variant is not None:
        row["variant_vs_base"] = med["panels" if variant_on_panels else "native"] / med["variant"]
    if pages_ab:
        row["huge_vs_4k"] = med["native_4k"] / med["native"]
        ranges = [(p, p + n) for p, n in memory.cpu_buffer_ranges(weights_4k)]
        row["huge_bytes_of_4k_copies"] = memory.huge_page_bytes(ranges)  # 0 unless THP is "always"
    return row


def print_row(r):
    s = r["native_s"]
    extra = f" {r['variant_s'] * 1e3:>8.2f} {r['variant_vs_base']:>6.2f}" if "variant_s" in r else ""
    extra += f" {r['native_4k_s'] * 1e3:>8.2f} {r['huge_vs_4k']:>6.2f}" if "native_4k_s" in r else ""
    extra += f" {r['width_vs_other']:>7.2f}" if "width_vs_other" in r else ""
    extra += "".join(f" {r[f'{level}_vs_top']:>{max(8, len(level) + 4)}.2f}" for level in cpu.ISA_LEVELS
                     if f"{level}_vs_top" in r)
    print(f"{r['E']:>3} {r['K']:>5} {r['C']:>5} {r['rows_per_expert']:>4} {r['dtype']:>8} {s * 1e3:>8.2f} "
          f"{r['weight_bytes'] / s / 1e9:>6.1f} {r['gflop'] / s:>7.1f} {r['xla_s'] * 1e3:>8.2f} {r['vs_xla']:>6.2f} "
          f"{r['x_floor']:>6.2f} {r['of_read_rate']:>6.2f} {r['panels_s'] * 1e3:>8.2f} {r['panels_vs_row_major']:>6.2f}"
          f" {r['panels_path']:>15}{extra}")
    sys.stdout.flush()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="*", default=list(ROWS_PER_EXPERT), help="rows per expert")
    parser.add_argument("--experts", type=int, nargs="*", default=sorted({s[0] for s in SHAPES}))
    parser.add_argument("--dtypes", nargs="*", default=list(DTYPES))
    parser.add_argument("--variant", type=pathlib.Path,
                        help="a modified kernel source to A/B against the committed one")
    parser.add_argument("--variant-on-panels", action="store_true",
                        help="run the --variant A/B on panel-major weights (its *Panels entry point)")
    parser.add_argument("--pages-ab", action="store_true",
                        help="also time the kernel on weights left on 4 KiB pages (interleaved)")
    parser.add_argument("--isa-ab", action="store_true",
                        help="also time the panel-major call at every lower instruction-set level (interleaved)")
    parser.add_argument("--width-ab", action="store_true",
                        help="also time the panel-major call on the other panel width (interleaved)")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    allocator.retain_freed_memory()  # as `serve --retain-freed-memory`, before JAX's first computation
    if not cpu.available():  # e.g. no C++ compiler: nothing to time (`make bench` goes on)
        print(f"skipped: native CPU kernel unavailable: {cpu.unavailable_reason()}")
        return
    variant = variant_call(args.variant, args.variant_on_panels) if args.variant else None
    load_before = os.getloadavg()
    bandwidth, read_rate = harness.copy_bandwidth(), harness.read_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read+write), read {read_rate / 1e9:.1f} GB/s; "
          f"jax {jax.__version__}; "
          f"kernel at {cpu.isa()}")
    print(f"{'E':>3} {'K':>5} {'C':>5} {'rows':>4} {'dtype':>8} {'ms':>8} {'GB/s':>6} {'GFLOP/s':>7} {'xla ms':>8} "
          f"{'vs xla':>6} {'x floor':>6} {'of read':>6} {'pan ms':>8} {'pan/rm':>6} {'path':>15}"
          + (f" {'var ms':>8} {'var/base':>6}" if variant else "")
          + (f" {'4k ms':>8} {'2M/4k':>6}" if args.pages_ab else "")
          + (f" {'pan/W' + str(80 - cpu.panel_columns()):>7}" if args.width_ab else "")
          + ("".join(f" {level + '/top':>8}" for level in diagnostics.supported_isas()[1:-1]) if args.isa_ab else ""))
    rows = []
    for e, k, c in SHAPES:
        if e not in args.experts:
            continue
        for dtype_name in args.dtypes:
            for m in args.rows:
                rows.append(run_case(e, k, c, m, dtype_name, bandwidth, read_rate, variant, args.reps, args.pages_ab,
                                     args.variant_on_panels, args.isa_ab, args.width_ab))
                print_row(rows[-1])
    harness.write_results(args.out, "native_cpu_kernel", rows, variant=str(args.variant or ""),
                  load_average_before=load_before, copy_bandwidth_bytes_per_s=bandwidth,
                  read_bandwidth_bytes_per_s=read_rate)


if __name__ == "__main__":
    main()
