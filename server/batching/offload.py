"""Host work of one large request off the event loop.

Decoding a big tensor body (NaN / Inf scan, cast to the serving dtype), assembling a big result
(joining its steps' rows, casting to the caller's dtype) and encoding it are milliseconds of numpy
per request; on the event loop they would hold up every other call, so a 1-token request admitted
beside an 8,192-token one would wait for them as well as for the device. `run` does such work on
the loop's default thread pool when it touches at least OFFLOAD_ELEMENTS elements (numpy's loops
release the GIL, so the loop keeps admitting and answering meanwhile), and inline otherwise,
where the hand-over would cost more than the work.
"""
from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# Elements (tokens x width) from which a request's host work leaves the loop: about a millisecond of
# casting and checking on one core, against the tens of microseconds of the hand-over.
OFFLOAD_ELEMENTS = 1 << 18


async def run(fn: Callable[..., T], *args, elements: int) -> T:
    """``fn(*args)``: on a worker thread when ``elements >= OFFLOAD_ELEMENTS``, else right here."""
    if elements < OFFLOAD_ELEMENTS:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))
