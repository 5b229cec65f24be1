"""The gRPC server's event loop (``--event-loop``): uvloop (libuv) where it is installed, else the
standard library's asyncio loop.

Every call of the server, health checks included, is Python on this one loop (grpc.aio runs on
any asyncio loop), so the loop's own cost per call is the server's per-call ceiling; uvloop's is
lower (BENCHMARKS.md, Serving). Nothing in the server depends on which loop runs it: times it
compares with request deadlines are ``time.monotonic`` values, never the loop's clock.

``loop_factory(choice) -> (factory, description)``: a zero-argument function making a new loop,
for ``asyncio.Runner``, and what to print ("uvloop 0.23.0", "asyncio"). ValueError naming the
flag when ``uvloop`` is asked for and is not installed; ``auto`` falls back to asyncio then.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable


def loop_factory(choice: str) -> tuple[Callable[[], asyncio.AbstractEventLoop], str]:
    """(a new-loop factory, its description) for ``--event-loop choice`` (module docstring)."""
    if choice != "asyncio":  # ServerConfig has checked it is one of EVENT_LOOPS
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise ValueError("--event-loop uvloop: uvloop is not installed (pip install uvloop; Linux and "
                                 "macOS), or use --event-loop asyncio") from None
        else:
            return uvloop.new_event_loop, f"uvloop {uvloop.__version__}"
    return asyncio.new_event_loop, "asyncio"
