"""expertd.server.multihost: one model served by a group of processes (jax.distributed).

Door: ``serve.serve(config)`` (what ``expertd serve`` runs in a group): process 0 leads (the
gRPC front end, ``app``, and ``serve.LeaderEngine`` sending each step to the others first over
``channel``), the others follow (``follower``: health and metrics, then the steps the leader
sends). The one package besides ``cli`` that imports ``app``.
"""
