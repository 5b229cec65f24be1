"""The benchmarks' harness: what every script in benchmarks/ does the same way, done once.

Scripts run as ``python benchmarks/<name>.py``, which puts benchmarks/ on ``sys.path``, so
``import harness`` finds this package. What it may import: the standard library at import time;
numpy, grpc, JAX and expertd (client, kernels, server) only inside the functions that need them, so
importing it loads no JAX (the hf_peer.py worker and the load processes import it too), and each
``expertd.server`` import the benchmarks share sits in one place here. It imports no script;
scripts import it, not each other (their own parts excepted: moe_layer.py's hf_peer.py and
moe_layer_options.py; cpu_peers.py's worker cpu_peer_engines.py, which builds transformers' block
with hf_peer.py's ``build_block``).

Modules and their public names (all importable from ``harness`` itself):

- ``servers``: ``free_port``, ``free_ports``; ``server_config`` (the ServerConfig a benchmark
  serves with: loopback, ports 0, one device) and ``running_server`` (``create_server`` in this
  process, ready, stopped when the block ends); ``ServeProcess``, ``start_serving`` and ``serving``
  (``expertd serve`` subprocesses: started, ready, restarted on another port where theirs was
  taken, stopped); ``ready_process`` (a child that prints "ready", killed when the block ends).
- ``layers``: the served models: ``MID_HF_CONFIG``, ``SERVED_BUCKETS``, ``tiny_layers``,
  ``seeded_layers``, ``benchmark_layers``, ``tiny_engine``; ``bucket_for``, ``padded_forward``
  (one step padded to its bucket, as the batcher pads it).
- ``load``: the raw-stub load (Check or single-token Forward callers in processes of their own):
  ``run_callers``, ``measure_load``, ``LOAD_START_S`` (in the module also ``callers``,
  ``start_callers``, ``finish``: one load process's pieces).
- ``cpu_time``: ``thread_cpu_s``, ``spent``, ``CpuSampler``: CPU time while a load runs.
- ``rounds``: A/B alternation and its arithmetic: ``order``, ``alternate``, ``timed``,
  ``time_calls`` / ``Timing``, ``interleaved_medians``, ``ratios``, ``median_ratio``, ``span``,
  ``spread``.
- ``probes``: measured rates: ``copy_bandwidth``, ``read_bandwidth``, ``copy_probes``,
  ``read_probes``, ``fastest``, ``paired_floors`` (a call against the copy and read floors of its
  own minute), ``dense_matmul_rate``, ``PROBE_BYTES``.
- ``cases``: the MoE layer cases the kernel benchmarks time: ``LAYER_SHAPES``, ``LAYER_DTYPES``,
  ``layer_config``, ``served_case``, ``selected_cases``.
- ``machine``: ``facts`` (platform, CPU model / vendor / family / cores / ISA flags, memory,
  versions), ``platform_facts``, ``cpu``, ``memory_bytes``, ``processor``, ``summary``,
  ``describe``, ``today``, ``now``.
- ``results``: ``RESULTS`` (benchmarks/results/), ``write_json`` (adds "host": ``facts()``),
  ``write_results`` (the kernels' JSON: rows, date, software, host_allocator state),
  ``print_table``.
"""
from harness import cases, cpu_time, layers, load, machine, probes, results, rounds, servers
from harness.cases import LAYER_DTYPES, LAYER_SHAPES, layer_config, selected_cases, served_case
from harness.cpu_time import CpuSampler, spent, thread_cpu_s
from harness.layers import (
    MID_HF_CONFIG,
    SERVED_BUCKETS,
    benchmark_layers,
    bucket_for,
    padded_forward,
    seeded_layers,
    tiny_engine,
    tiny_layers,
)
from harness.load import LOAD_START_S, measure_load, run_callers
from harness.probes import (
    PROBE_BYTES,
    copy_bandwidth,
    copy_probes,
    dense_matmul_rate,
    fastest,
    paired_floors,
    read_bandwidth,
    read_probes,
)
from harness.results import RESULTS, print_table, write_json, write_results
from harness.rounds import (
    Timing,
    alternate,
    interleaved_medians,
    median_ratio,
    order,
    ratios,
    span,
    spread,
    time_calls,
    timed,
)
from harness.servers import (
    ServeProcess,
    free_port,
    free_ports,
    ready_process,
    running_server,
    server_config,
    serving,
    start_serving,
)

__all__ = [
    "CpuSampler", "LAYER_DTYPES", "LAYER_SHAPES", "LOAD_START_S", "MID_HF_CONFIG", "PROBE_BYTES", "RESULTS",
    "SERVED_BUCKETS", "ServeProcess", "Timing", "alternate", "benchmark_layers", "bucket_for", "cases",
    "copy_bandwidth", "copy_probes", "cpu_time", "dense_matmul_rate", "fastest", "free_port", "free_ports",
    "interleaved_medians", "layer_config", "layers", "load", "machine", "measure_load", "median_ratio", "order",
    "padded_forward", "paired_floors", "print_table", "probes", "ratios", "read_bandwidth", "read_probes",
    "ready_process", "results", "rounds", "run_callers", "running_server", "seeded_layers", "selected_cases",
    "served_case", "server_config", "servers", "serving", "span", "spent", "spread", "start_serving",
    "thread_cpu_s", "time_calls", "timed", "tiny_engine", "tiny_layers", "write_json", "write_results",
]
