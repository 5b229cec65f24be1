"""expertd.server: the gRPC expert service. One room per subpackage, each with one door:

- config: the only reader of flags, TOML and environment -> ServerConfig (one module per section)
- frontends: add_services -- expertd.v1 and KServe v2; requests decoded, validated, cast once
- transport: what every call passes -- auth, limits, metrics per method, health, drain, listen
- native_front: NativeFront -- the native Forward port, gRPC C++ over the same batcher
- shm_channel: ShmChannel -- the same-host channel (shm://NAME), the gRPC port's handlers
- batching: Batcher -- admission, queues, steps, results; one owner (the event loop)
- engine: api (StepRunner, step kinds, outputs, ModelDescription) -- build, compile, run, EPLB
- models, metrics, host, multihost: the model registry and checkpoints; every Prometheus family;
  huge pages, allocator, process settings; groups of processes. app, cli: assembly and the CLI.
"""
