"""expertd.server.host: the process and its host memory, set once at start-up.

``process.prepare_process`` (before JAX: the host allocator, the native kernel's options),
``allocator`` (glibc malloc's settings: keep freed buffers) and ``memory`` (the CPU weights on
transparent huge pages). Imports: ``config`` and ``expertd.kernels.cpu``.
"""
