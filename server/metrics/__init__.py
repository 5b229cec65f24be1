"""expertd.server.metrics: every Prometheus family the server exports, and its HTTP endpoint.

Door: ``Metrics`` (``families``: the ``expertd_*`` families and the recording methods the server
calls), with ``calls`` (the ``grpc_server_*`` series, every transport's calls in them),
``native_port`` (the native Forward port's own families), ``statistics`` (KServe's
ModelStatistics counts), ``expert_load`` (per-expert token counts over a window) and ``http``
(``GET /metrics``). Imports nothing of the server but ``config`` (the endpoint's settings).
"""
from expertd.server.metrics.families import LATENCY_BUCKETS, Metrics

__all__ = ["LATENCY_BUCKETS", "Metrics"]
