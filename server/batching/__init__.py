"""expertd.server.batching: requests admitted by cost and deadline, merged into engine steps.

Door: ``Batcher`` (``batcher``): ``admit`` a request's header, then ``forward`` / ``route`` the
decoded request (``requests``: the typed requests the front ends build). Behind it: ``admission``
(bounds and step-time estimates), ``queues`` (per layer and step kind, fair), ``scheduling`` (the
scheduler tasks, the step on the device thread, results cut back per request), ``device_steps``
(one step and the calibration), ``results`` (the client's result types), ``offload`` (large work
off the loop) and ``direct`` (``Batcher.direct``: a lone call computed on a transport's thread).

Threads: the event loop owns the batcher; ``direct`` is the one entry for other threads and shares
only what its lock guards. Imports: ``engine.api``, ``metrics``, ``errors``, ``config`` and the
client's messages; no JAX (``tests/test_imports.py``).
"""
