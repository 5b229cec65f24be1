"""``expertd``: the console script. ``expertd serve [flags]`` runs the server; any other subcommand
(``info``, ``route``, ``forward``, ``load``, ``health``, ...) belongs to ``expertd.client.cli``.

``expertd serve`` prints the ports it bound and the warm-up progress, then serves until SIGTERM or
SIGINT, on which it drains (finishes accepted requests within ``--drain-grace-s``) and exits 0.
Exit status 2 for bad flags or configuration, 1 when loading or warm-up fails.
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import signal
import sys
import time

USAGE = """usage: expertd serve [--help] [flags]     serve MoE layers over gRPC
       expertd <command> [...]              client commands (expertd.client.cli): info, route,
                                            forward, load, health, ...
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    if argv[0] == "serve":
        return serve(argv[1:])
    if importlib.util.find_spec("expertd.client.cli") is None:
        print(f"expertd: unknown command {argv[0]!r}; the client commands (expertd.client.cli) are not "
              f"installed\n{USAGE}", end="", file=sys.stderr)
        return 2
    from expertd.client import cli

    return cli.main(argv)


def serve(argv: list[str]) -> int:
    from expertd.server import config as config_module
    from expertd.server import multihost

    parser = argparse.ArgumentParser(prog="expertd serve", description="Serve MoE layers over gRPC: Forward and "
                                     "Route for the layers of a model preset or a Hugging Face checkpoint.")
    config_module.add_arguments(parser)
    multihost.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        group = multihost.pop_args(args)
        config = config_module.from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.retain_freed_memory:  # before any JAX work: see host_allocator
        from expertd.server import host_allocator

        host_allocator.retain_freed_memory()
    if group.enabled:  # one process of a multi-host group (docs/deploy.md)
        return multihost.serve(config, group)
    say(f"loading {config.model.name} ({config.model.dtype})")
    from expertd.server.app import create_server

    started = time.perf_counter()
    try:
        handle = create_server(config, progress=_print_progress)
    except (ValueError, OSError) as exc:
        say(f"error: {exc}")
        return 1
    host = config.host
    say(f"gRPC listening on {host}:{handle.port}" + (" (TLS)" if config.security.tls_cert else ""))
    say(f"metrics on http://{host}:{handle.metrics_port}/metrics")
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: handle.request_stop())
    try:
        handle.wait_ready()
    except RuntimeError as exc:
        say(f"error: {exc}")
        handle.stop(0)
        return 1
    say(f"ready: {len(handle.engine.layers)} layers, buckets {list(handle.engine.buckets)}, "
        f"{time.perf_counter() - started:.1f}s after start")
    info = handle.engine.info()
    for note in (_native_kernel_note(info["native_cpu_kernel"], info["panel_columns"]),
                 _huge_pages_note(info["huge_pages"]), _host_allocator_note(info["host_allocator"])):
        if note:
            say(note)
    while not handle.wait(0.5):  # short waits keep the main thread responsive to signals
        pass
    say("drained, exiting")
    return 0


def say(message: str) -> None:
    print(f"expertd: {message}", flush=True)


def _native_kernel_note(status: dict | None, panel_columns: int | None = None) -> str | None:
    """The line `serve` prints about the native CPU expert kernel (status, panel_columns:
    Engine.info()'s): the instruction set it runs at and the weights' panel width, or why it could
    not be built; None off CPU."""
    if status is None:
        return None
    if status["available"]:
        layout = f", expert weights in {panel_columns}-column panels" if panel_columns else ""
        return f"native CPU expert kernel: {status['isa']} instructions{layout}"
    return (f"note: the native CPU expert kernel is unavailable ({status['reason']}); the experts run "
            "XLA's slower paths")


def _huge_pages_note(report: dict | None) -> str | None:
    """The line `serve` prints about the weights' pages (report: Engine.info()["huge_pages"]);
    None without weights big enough for a huge page (the tiny preset) or off CPU."""
    if not report or not report["eligible_bytes"]:
        return None
    from expertd.server import host_memory

    return "weights: " + host_memory.summary(report)


def _host_allocator_note(state: dict | None) -> str | None:
    """The line `serve` prints about host malloc (state: Engine.info()["host_allocator"]); None off CPU."""
    if state is None:
        return None
    from expertd.server import host_allocator

    return "host memory: " + host_allocator.summary(state)


def _print_progress(event) -> None:
    options = ", ".join(f"{name}={value!r}" for name, value in sorted(event.compiler_options.items()))
    say(f"compiled {event.done}/{event.total}: {event.kind} bucket {event.bucket} for layers "
        f"{','.join(map(str, event.layers))} in {event.seconds:.2f}s"
        + (f" (experts: {event.expert_backend})" if event.expert_backend else "")
        + (f" (XLA options: {options})" if options else ""))


if __name__ == "__main__":
    sys.exit(main())
