"""``expertd``: the console script. ``expertd serve [flags]`` runs the server; any other subcommand
(``info``, ``route``, ``forward``, ``load``, ``health``, ...) belongs to ``expertd.client.cli``.

``expertd serve`` prints the ports it bound and the warm-up progress, then serves until SIGTERM or
SIGINT, on which it drains (finishes accepted requests within ``--drain-grace-s``) and exits 0.
Exit status 2 for bad flags or configuration, 1 when loading or warm-up fails.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import time

from expertd.client import cli as client_cli
from expertd.server import config as config_module
from expertd.server.console import print_progress, say
from expertd.server.process import prepare_process

USAGE = """usage: expertd serve [--help] [flags]     serve MoE layers over gRPC
       expertd <command> [...]              client commands (expertd.client.cli): info, route,
                                            forward, load, health, ...
"""


def main(argv: list[str] | None = None) -> int:
    argv = config_module.command_line() if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    if argv[0] == "serve":
        return serve(argv[1:])
    return client_cli.main(argv)


def parser() -> argparse.ArgumentParser:
    """The flags of ``expertd serve`` (every option of ``expertd.server.config``)."""
    parser = argparse.ArgumentParser(prog="expertd serve", description="Serve MoE layers over gRPC: Forward and "
                                     "Route for the layers of a model preset or a Hugging Face checkpoint.")
    config_module.add_arguments(parser)
    return parser


def serve(argv: list[str]) -> int:
    serve_parser = parser()
    args = serve_parser.parse_args(argv)
    try:
        config = config_module.from_args(args)
    except ValueError as exc:
        serve_parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prepare_process(config)  # before any JAX work
    # Imported here, after prepare_process: the server's modules load JAX, which client commands
    # (and the host allocator's settings) must not pay for or run after.
    from expertd.server import app, multihost

    if config.multihost.enabled:  # one process of a multi-host group (docs/deploy.md)
        return multihost.serve(config)
    say(f"loading {config.model.name} ({config.model.dtype})")
    started = time.perf_counter()
    try:
        handle = app.create_server(config, progress=print_progress)
    except (ValueError, OSError) as exc:
        say(f"error: {exc}")
        return 1
    host = config.host
    say(f"gRPC listening on {host}:{handle.port}" + (" (TLS)" if config.security.tls_cert else ""))
    say(f"metrics on {handle.metrics_url}")
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: handle.request_stop())
    try:
        handle.wait_ready()
    except RuntimeError as exc:
        say(f"error: {exc}")
        handle.stop(0)
        return 1
    say(f"ready: {len(handle.model.layers)} layers, buckets {list(handle.model.buckets)}, "
        f"{time.perf_counter() - started:.1f}s after start")
    for note in handle.served.notes():
        say(note)
    while not handle.wait(0.5):  # short waits keep the main thread responsive to signals
        pass
    say("drained, exiting")
    return 0


if __name__ == "__main__":
    sys.exit(main())
