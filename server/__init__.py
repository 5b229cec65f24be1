"""expertd.server: the gRPC expert service.

One job per module:
- config (package): the only reader of flags, the TOML file and the environment.
- process: process-wide settings applied once before JAX (host allocator, native kernel options).
- model, checkpoint: the layers served (presets, Hugging Face checkpoints).
- startup: layers -> placement -> weights -> host_memory -> Engine, and the ModelDescription.
- placement, weights, host_memory, host_allocator, warmup: the start-up steps, each applied once.
- engine, steps: compile and run the steps (trusted inputs).
- description, requests, kserve_requests: what the front ends see; requests (expertd.v1; KServe v2)
  decoded, validated and cast once. shared_memory: the registered shared-memory regions both use.
- batcher, expert_load: requests merged into engine steps; per-expert load.
- servicer (expertd.v1), kserve (KServe v2): the front ends, over the batcher and the description.
- errors: every failure and its gRPC status. metrics, statistics, interceptors: one observation per event.
- app: assembly and lifecycle; metrics_http: the /metrics endpoint; drain: what a drain ends (health
  Watches, request streams); cli, console: ``expertd serve``; multihost*: groups of processes.
- version: the one version string.
"""
