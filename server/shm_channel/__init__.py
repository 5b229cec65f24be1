"""expertd.server.shm_channel: the same-host channel (``--shm-channel NAME``, clients' ``shm://NAME``).

Door: ``ShmChannel.start(name, handlers, ...)`` listens; the server gives it the handlers of the
unary methods it carries (``frontends.ExpertServicer.unary_methods`` and health's Check), so a call
on the channel takes the one request path of the gRPC port; ``quiesce`` and ``stop`` drain it. The
wire format is ``expertd.client.shm_frames``; docs/attention.md has the picture and the bounds.

Imports: ``batching`` and ``frontends`` (the direct path: the servicer's checks, then
``Batcher.direct``), ``errors``, ``metrics``, ``transport.auth`` / ``transport.interceptors`` (the
token check, the undecodable-message text) and the client's wire format. No JAX.
"""
from __future__ import annotations

from expertd.server.shm_channel.channel import Handler, ShmChannel

__all__ = ["Handler", "ShmChannel"]
