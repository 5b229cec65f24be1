"""expertd.server.engine: the layers' weights placed and prepared, their steps compiled and run.

Door: ``api`` (the step protocol ``StepRunner``, the step kinds, ``ForwardOutput`` /
``RouteOutput``, ``ModelDescription``, ``pad_rows``, ``cast``): the only names the front ends and
the batcher use, and JAX-free. Behind it: ``build`` (start-up: layers -> placement -> weights ->
huge pages -> ``Engine``), ``engine`` (compile and run the steps), ``steps`` (the jitted step
functions), ``placement`` (the device mesh), ``weights`` (placed and prepared once), ``warmup``
(every bucket compiled ahead), ``rebalancer`` (online EPLB), ``description`` (the read-only model
description). Imports: ``expertd.kernels``, ``models``, ``host``, ``errors``, ``config``.
"""
