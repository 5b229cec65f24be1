"""Shared by the CLI and load-test tests: a real server (tiny preset, fp32) on a loopback port 0.

Uses the same JAX persistent compilation cache folder as the service tests (under pytest's base
temp dir), so a session compiles each (layer shape, bucket) once.
"""
from __future__ import annotations

import contextlib

from expertd.server.app import create_server
from expertd.server.config import BatchingConfig, ModelConfig, ServerConfig


@contextlib.contextmanager
def running_server(tmp_path_factory, *, shm_channel: str | None = None, **batching):
    """A started, warmed-up server; stopped on exit. ``batching``: BatchingConfig fields;
    ``shm_channel``: serve the same-host channel at that socket path too."""
    config = ServerConfig(
        host="127.0.0.1", port=0, metrics_port=0, shm_channel=shm_channel,
        compile_cache_dir=str(tmp_path_factory.getbasetemp() / "expertd-jax-cache"),
        model=ModelConfig(preset="tiny", dtype="float32", num_devices=1),
        batching=BatchingConfig(**{"bucket_sizes": (1, 8), **batching}),
    )
    handle = create_server(config)
    try:
        handle.wait_ready(timeout=300)
        yield handle
    finally:
        handle.stop(grace=5)


def free_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ok_count(handle, service: str, method: str) -> float:
    labels = {"grpc_type": "unary", "grpc_service": service, "grpc_method": method, "grpc_code": "OK"}
    return handle.registry.get_sample_value("grpc_server_handled_total", labels) or 0.0


def forward_ok_count(handle) -> float:
    """expertd.v1 Forward requests the server answered OK (its own counter)."""
    return _ok_count(handle, "expertd.v1.ExpertService", "Forward")


def model_infer_ok_count(handle) -> float:
    """KServe ModelInfer requests the server answered OK."""
    return _ok_count(handle, "inference.GRPCInferenceService", "ModelInfer")
