"""expertd.server.transport: what every gRPC call passes before and after its front end.

``registration.wrapping`` (every method wrapped once: ``interceptors``' auth before the body,
message limits, ``grpc_server_*`` metrics), ``auth`` (the bearer token), ``drain`` (health and
the drain's stream inputs), ``reflection``, ``listen`` (ports, TLS, the security line) and
``event_loop`` (uvloop or asyncio). Imports: ``metrics``, ``errors``, ``config``.
"""
