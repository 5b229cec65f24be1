"""``expertd``: the console script. ``expertd serve [flags]`` runs the server, ``expertd inspect DIR``
describes a checkpoint; any other subcommand (``info``, ``route``, ``forward``, ``load``,
``health``, ...) belongs to ``expertd.client.cli``.

``expertd serve`` prints the serving dtype and why, the ports it bound and the warm-up progress,
then serves until SIGTERM or SIGINT, on which it drains (finishes accepted requests within
``--drain-grace-s``) and exits 0. Exit status 2 for bad flags or configuration and for a checkpoint
expertd does not serve (an unknown model, missing semantics, an unsupported quantization_config:
refused before loading), 1 when loading or warm-up fails.

``expertd inspect DIR [--layers LIST] [--dtype D] [--json]`` reads config.json and the safetensors
headers only (``expertd.server.models.inspect``): exit 0 when ``serve`` would serve it, 2 when it refuses.
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time

from expertd.client import cli as client_cli
from expertd.server import config as config_module
from expertd.server.console import print_progress, say

USAGE = """usage: expertd serve [--help] [flags]     serve MoE layers over gRPC
       expertd inspect DIR [--json]         what a checkpoint is and what serve would do with it
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
    if argv[0] == "inspect":
        return inspect(argv[1:])
    return client_cli.main(argv)


def inspect(argv: list[str]) -> int:
    """``expertd inspect``: print what the checkpoint is and what serve would do (see module docstring)."""
    parser = argparse.ArgumentParser(prog="expertd inspect", description="Describe a Hugging Face MoE checkpoint "
                                     "(config.json and safetensors headers only) and what `expertd serve` would do "
                                     "with it. Exit 0: servable; 2: refused (the reason is printed).")
    parser.add_argument("checkpoint", metavar="DIR", help="checkpoint directory (config.json + *.safetensors)")
    parser.add_argument("--layers", default=None, metavar="LIST", help="MoE layers to plan, e.g. '3,5-7'")
    parser.add_argument("--dtype", default="auto", choices=config_module.DTYPES, help="as expertd serve's --dtype")
    parser.add_argument("--expert-weights", default="dtype", choices=config_module.EXPERT_WEIGHTS,
                        help="as expertd serve's --expert-weights")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    # Imported here, as serve's modules are: client commands must not pay for loading JAX.
    from expertd.server.models.inspect import format_report, inspect_checkpoint

    report = inspect_checkpoint(args.checkpoint, layers=args.layers, dtype=args.dtype,
                                expert_weights=args.expert_weights)
    print(json.dumps(report, indent=2) if args.json else format_report(report), end="\n" if args.json else "")
    return 0 if report["servable"] else 2


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
    # Imported here: it loads JAX (the native kernel's build), which client commands must not pay for.
    from expertd.server.host.process import prepare_process

    prepare_process(config)  # before any JAX work
    # Imported here, after prepare_process: the server's modules load JAX, which client commands
    # (and the host allocator's settings) must not pay for or run after.
    from expertd.server import app
    from expertd.server.engine.build import serving_dtype  # as above
    from expertd.server.models.checkpoint import CheckpointRefused  # as above: it loads JAX
    from expertd.server.multihost.serve import serve as serve_group  # as above

    try:  # config.json and headers only: a checkpoint expertd does not serve is refused before loading
        dtype, why = serving_dtype(config.model)
    except CheckpointRefused as exc:
        say(f"error: {exc}")
        return 2
    except ValueError as exc:
        say(f"error: {exc}")
        return 1
    say(f"loading {config.model.name} in {dtype} ({why})")
    if config.multihost.enabled:  # one process of a multi-host group (docs/deploy.md)
        return serve_group(config)
    started = time.perf_counter()
    try:
        handle = app.create_server(config, progress=print_progress)
    except (ValueError, OSError) as exc:
        say(f"error: {exc}")
        return 1
    say(handle.listening_summary())
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
