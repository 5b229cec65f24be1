"""expertd.server: the gRPC expert service.

One job per module:
- config (package): the only reader of flags, the TOML file and the environment.
- process: process-wide settings applied once before JAX (host allocator, native kernel options).
- models (package): the model registry (one module per family: config.json -> MoE layers, tensor
  names), checkpoint formats and dequantisers; model, checkpoint (plan), checkpoint_layer (one
  layer's tensors read): the layers served (presets, Hugging Face checkpoints); inspect:
  ``expertd inspect DIR`` (what serve would do, or why not).
- startup: layers -> placement -> weights -> host_memory -> Engine, and the ModelDescription.
- placement, weights, host_memory, host_allocator, warmup: the start-up steps, each applied once.
- engine, steps: compile and run the steps (trusted inputs); eplb: online expert rebalancing.
- description, requests, kserve_requests: what the front ends see; requests (expertd.v1; KServe v2)
  decoded, validated and cast once. shared_memory: the registered shared-memory regions both use.
- batcher, queues, admission, device_steps, expert_load: requests admitted by cost and deadline,
  queued fairly and merged into engine steps (run on the device-worker thread); per-expert load.
- servicer (expertd.v1), kserve (KServe v2): the front ends, over the batcher and the description.
- errors: every failure and its gRPC status. metrics, statistics, interceptors (auth, limits, metrics
  per method), reflection: one observation per event.
- app: assembly and lifecycle; metrics_http: the /metrics endpoint; drain: what a drain ends (health
  Watches, request streams); cli, console: ``expertd serve``; multihost*: groups of processes.
- version: the one version string.
"""
