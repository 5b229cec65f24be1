"""The operator commands of ``expertd``: info, health, route, forward, load, loadtest.

    expertd info     --target HOST:PORT              layers, shapes, router settings, buckets, mesh
    expertd health   [--service NAME] [--wait S]     grpc.health.v1 status (exit 0 only when SERVING)
    expertd route    --layer L [--tokens T | --input x.npy | --logits l.npy]
    expertd forward  --layer L [--tokens T | --input x.npy] [--output y.npy] [--routing]
    expertd load     [--layers 0,3] [--plot load.png]
    expertd loadtest --layer L --concurrency 1,4,16 | --rate 50,200  (see expertd.client.loadtest)

Tables for people by default; ``--json`` prints one JSON document on stdout for machines.
Every command only talks to ``--target`` (default ``$EXPERTD_TARGET`` or ``localhost:8001``): one
server or its replicas (``host1:port,host2:port``, ``dns:///name:port``), calls balanced over the
SERVING ones (``expertd.client.channel``).

Exit codes (stable; scripts may rely on them):
  0  success (health: SERVING)
  1  other error (INTERNAL, UNKNOWN, UNAUTHENTICATED, a missing optional dependency, ...)
  2  invalid argument: bad flags or input files, or the server answered INVALID_ARGUMENT,
     NOT_FOUND or OUT_OF_RANGE
  3  unavailable: the server cannot be reached, is not SERVING, or answered UNAVAILABLE,
     RESOURCE_EXHAUSTED or DEADLINE_EXCEEDED (try again later)

``expertd serve`` lives in expertd.server.cli, which hands every other command to :func:`run`.
This module never imports JAX.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import grpc
import numpy as np

from expertd.client import errors, loadtest, loadtest_flags, loadtest_report
from expertd.client.channel import TlsOptions
from expertd.client.cli_output import (
    array_summary,
    expert_load_table,
    import_pyplot,
    info_dict,
    info_table,
    load_dict,
    routing_table,
    write_load_plot,
)
from expertd.client.client import ExpertClient

EXIT_OK, EXIT_ERROR, EXIT_INVALID_ARGUMENT, EXIT_UNAVAILABLE = 0, 1, 2, 3
_INVALID = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE}
_UNAVAILABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}
DTYPE_CHOICES = tuple(loadtest.DTYPES)


def exit_code_for(code: grpc.StatusCode) -> int:
    """The process exit code for a failed call's gRPC status."""
    if code in _INVALID:
        return EXIT_INVALID_ARGUMENT
    if code in _UNAVAILABLE:
        return EXIT_UNAVAILABLE
    return EXIT_ERROR


def _connection_arguments(parser: argparse.ArgumentParser, *, json_flag: bool = True) -> None:
    group = parser.add_argument_group("connection")
    group.add_argument("--target", default=os.environ.get("EXPERTD_TARGET", "localhost:8001"),
                       help="server host:port, or replicas: host1:port,host2:port or dns:///name:port (a name "
                            "with several addresses), or shm://NAME (the same-host channel of --shm-channel NAME) "
                            "(default: $EXPERTD_TARGET or localhost:8001)")
    group.add_argument("--timeout", type=float, default=30.0, help="deadline of each call in seconds (default 30)")
    group.add_argument("--tls", action="store_true", help="use TLS (system roots unless --ca-cert)")
    group.add_argument("--ca-cert", help="PEM file of the CA that signed the server certificate (implies --tls)")
    group.add_argument("--client-cert", help="PEM certificate chain of this client, for a server that requires "
                                             "mutual TLS (with --client-key; implies --tls)")
    group.add_argument("--client-key", help="PEM private key of --client-cert")
    group.add_argument("--server-name", help="the name the server's certificate must hold, when it is not the "
                                             "target's host (e.g. probing localhost:8001 in a pod; implies --tls)")
    group.add_argument("--token", default=os.environ.get("EXPERTD_TOKEN"),
                       help="bearer token (default: $EXPERTD_TOKEN)")
    if json_flag:
        parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")


def _tls(args) -> bool | TlsOptions:
    """The channel's TLS from the connection flags (ValueError naming them when half of a pair is given)."""
    if (args.client_cert is None) != (args.client_key is None):
        raise ValueError("--client-cert and --client-key go together (mutual TLS)")
    if args.ca_cert or args.client_cert or args.server_name:
        return TlsOptions(root_certificates=args.ca_cert, client_certificate=args.client_cert,
                          client_key=args.client_key, server_name=args.server_name)
    return bool(args.tls)


def _client(args, retries: int = 0) -> ExpertClient:
    return ExpertClient(args.target, timeout=args.timeout, retries=retries, tls=_tls(args), token=args.token)


def _emit(args, document: dict, text: str) -> None:
    print(json.dumps(document, indent=2) if args.json else text)


def _layer_info(client: ExpertClient, layer: int):
    info = client.model_info()
    for item in info.layers:
        if item.index == layer:
            return item
    raise ValueError(f"--layer: the server holds layers {[item.index for item in info.layers]}, not {layer}")


def _input_array(args, client: ExpertClient, layer_info) -> np.ndarray:
    """``x [T, H]`` from ``--input`` (a .npy; 2-byte void arrays are numpy's way of saving bfloat16)
    or random normal values of ``--tokens`` rows."""
    dtype = loadtest.DTYPES[args.dtype] if args.dtype else None
    if args.input:
        x = np.load(args.input, allow_pickle=False)
        if x.dtype == np.dtype("V2"):
            x = x.view(loadtest.DTYPES["bfloat16"])
        if x.ndim != 2 or x.shape[1] != layer_info.hidden_size:
            raise ValueError(f"--input: expected an array [T, {layer_info.hidden_size}], got shape {list(x.shape)}")
        return x.astype(dtype) if dtype is not None else x
    if args.tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {args.tokens}")
    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal((args.tokens, layer_info.hidden_size), dtype=np.float32)
    return x.astype(dtype or loadtest.DTYPES["bfloat16"])


def cmd_info(args) -> int:
    with _client(args) as client:
        info = client.model_info()
    _emit(args, info_dict(info), info_table(info))
    return EXIT_OK


def cmd_health(args) -> int:
    from grpc_health.v1 import health_pb2

    with _client(args) as client:
        if args.wait:
            try:
                client.wait_ready(timeout=args.wait, service=args.service)
            except TimeoutError:
                pass
        try:
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(client.health(args.service))
        except errors.ExpertError as error:
            if error.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                  grpc.StatusCode.NOT_FOUND):
                raise
            status = "SERVICE_UNKNOWN" if error.code == grpc.StatusCode.NOT_FOUND else "UNREACHABLE"
    document = {"target": args.target, "service": args.service, "status": status}
    _emit(args, document, f"{args.target} {args.service or '(server)'}: {status}")
    return EXIT_OK if status == "SERVING" else EXIT_UNAVAILABLE


def cmd_route(args) -> int:
    with _client(args) as client:
        layer_info = _layer_info(client, args.layer)
        started = time.perf_counter()
        if args.logits:
            logits = np.load(args.logits, allow_pickle=False)
            if logits.ndim != 2 or logits.shape[1] != layer_info.num_experts:
                raise ValueError(f"--logits: expected an array [T, {layer_info.num_experts}], "
                                 f"got shape {list(logits.shape)}")
            result = client.route(layer=args.layer, logits=logits.astype(np.float32))
        else:
            result = client.route(_input_array(args, client, layer_info), layer=args.layer)
        latency_ms = (time.perf_counter() - started) * 1e3
    if args.output:
        np.savez(args.output, topk_ids=result.topk_ids, topk_weights=result.topk_weights,
                 tokens_per_expert=result.tokens_per_expert)
    document = {
        "layer": args.layer,
        "tokens": int(result.topk_ids.shape[0]),
        "topk": int(result.topk_ids.shape[1]),
        "aux_loss": result.aux_loss,
        "latency_ms": latency_ms,
        "tokens_per_expert": result.tokens_per_expert.tolist(),
        "topk_ids": result.topk_ids.tolist(),
        "topk_weights": result.topk_weights.tolist(),
        "saved_to": args.output,
    }
    text = routing_table(args.layer, result.topk_ids, result.topk_weights, result.tokens_per_expert, show=args.show)
    text += f"\naux loss {result.aux_loss:.6g}   latency {latency_ms:.1f} ms"
    text += f"\nsaved to {args.output}" if args.output else ""
    _emit(args, document, text)
    return EXIT_OK


def cmd_forward(args) -> int:
    with _client(args) as client:
        layer_info = _layer_info(client, args.layer)
        x = _input_array(args, client, layer_info)
        started = time.perf_counter()
        result = client.forward(x, layer=args.layer, return_routing=args.routing)
        latency_ms = (time.perf_counter() - started) * 1e3
    output = result.output if args.routing else result
    saved_dtype = None
    if args.output:
        # numpy cannot tag bfloat16 in a .npy (it saves raw 2-byte voids): store it as float32, exactly.
        saved = output.astype(np.float32) if output.dtype == loadtest.DTYPES["bfloat16"] else output
        np.save(args.output, saved, allow_pickle=False)
        saved_dtype = str(saved.dtype)
    document = {
        "layer": args.layer,
        "input": array_summary(x),
        "output": array_summary(output),
        "latency_ms": latency_ms,
        "saved_to": args.output,
        "saved_dtype": saved_dtype,
    }
    lines = [
        f"layer {args.layer}: input {_describe(document['input'])}",
        f"output {_describe(document['output'])}",
        f"latency {latency_ms:.1f} ms",
    ]
    if args.output:
        lines.append(f"saved to {args.output} ({saved_dtype})")
    if args.routing and result.routing is not None:
        r = result.routing
        document["routing"] = {"tokens_per_expert": r.tokens_per_expert.tolist(), "topk_ids": r.topk_ids.tolist(),
                               "topk_weights": r.topk_weights.tolist()}
        lines.append(routing_table(args.layer, r.topk_ids, r.topk_weights, r.tokens_per_expert, show=args.show))
    _emit(args, document, "\n".join(lines))
    return EXIT_OK


def _describe(summary: dict) -> str:
    return (
        f"{summary['shape']} {summary['dtype']}  mean {summary['mean']:.4g}  std {summary['std']:.4g}  "
        f"min {summary['min']:.4g}  max {summary['max']:.4g}  finite {'yes' if summary['finite'] else 'NO'}"
    )


def cmd_load(args) -> int:
    layers = _int_list(args.layers, "--layers") if args.layers else []
    if args.plot:
        import_pyplot()
    with _client(args) as client:
        loads = client.expert_load(layers)
    if args.plot:
        write_load_plot(loads, args.plot, recent=args.recent)
    document = load_dict(loads)
    text = expert_load_table(loads) + (f"\nplot written to {args.plot}" if args.plot else "")
    _emit(args, document, text)
    return EXIT_OK


def cmd_loadtest(args) -> int:
    config = loadtest_flags.config_from(args, tls=_tls(args))
    if args.plot:
        import_pyplot()  # fail before the load test, not after it
    show_progress = sys.stderr.isatty() if args.progress is None else args.progress
    progress = loadtest_report.Progress(sys.stderr) if show_progress else None
    report = asyncio.run(loadtest.run_loadtest(config, progress))
    if args.plot:
        loadtest_report.write_plot(report, args.plot)
    if args.json == "-":
        print(json.dumps(report, indent=2))
        return EXIT_OK
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    print(loadtest_report.format_table(report))
    return EXIT_OK


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated integers, got {text!r}") from None


def _tensor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layer", type=int, default=0, help="layer index (default 0)")
    parser.add_argument("--input", help="a .npy of hidden states [T, H] (default: random)")
    parser.add_argument("--tokens", type=int, default=16, help="rows of the random input (default 16)")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES,
                        help="send the input in this dtype (default: random bfloat16, or the file's dtype)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random input")
    parser.add_argument("--show", type=int, default=4, help="tokens whose top-k is printed in the table (default 4)")


def add_subcommands(subparsers) -> None:
    """Add info, health, route, forward, load and loadtest to an ``add_subparsers()`` object.

    Each parser sets ``client_command``; hand the parsed namespace to :func:`run`.
    """
    commands = {}
    commands["info"] = subparsers.add_parser("info",
                                             help="layers, shapes, router settings, buckets and mesh of a server")
    commands["health"] = subparsers.add_parser("health", help="grpc.health.v1 status; exit 0 only when SERVING")
    commands["health"].add_argument("--service", default="", help="health service name (default: the whole server)")
    commands["health"].add_argument("--wait", type=float, default=0.0, help="wait up to this many seconds for SERVING")
    commands["route"] = subparsers.add_parser("route", help="the router's top-k decisions for hidden states or logits")
    _tensor_arguments(commands["route"])
    commands["route"].add_argument("--logits", help="a .npy of router logits [T, E] instead of hidden states")
    commands["route"].add_argument("--output", help="save topk_ids, topk_weights, tokens_per_expert to this .npz")
    commands["forward"] = subparsers.add_parser("forward", help="run the MoE layer on random or .npy hidden states")
    _tensor_arguments(commands["forward"])
    commands["forward"].add_argument("--output", help="save the output [T, H] to this .npy (bfloat16 saved as float32)")
    commands["forward"].add_argument("--routing", action="store_true", help="also show the routing decisions")
    commands["load"] = subparsers.add_parser("load", help="tokens routed to each expert, per layer")
    commands["load"].add_argument("--layers", help="comma-separated layer indices (default: every layer)")
    commands["load"].add_argument("--plot", help="write a bar chart PNG to this path (needs matplotlib)")
    commands["load"].add_argument("--recent", action="store_true", help="plot the recent window instead of the totals")
    commands["loadtest"] = subparsers.add_parser("loadtest",
                                                 help="closed- or open-loop load test with a latency/throughput report")
    loadtest_flags.add_arguments(commands["loadtest"])
    handlers = {"info": cmd_info, "health": cmd_health, "route": cmd_route, "forward": cmd_forward, "load": cmd_load,
                "loadtest": cmd_loadtest}
    for name, parser in commands.items():
        _connection_arguments(parser, json_flag=name != "loadtest")  # loadtest's --json takes a PATH
        parser.set_defaults(client_command=handlers[name])


def run(args: argparse.Namespace) -> int:
    """Run a parsed client command; failures become a one-line message on stderr and an exit code."""
    try:
        return args.client_command(args)
    except errors.ExpertError as error:
        return _failed_call(error)
    except grpc.RpcError as error:
        return _failed_call(errors.from_rpc_error(error))
    except (ValueError, OSError) as error:  # bad flags or input files (FileNotFoundError is an OSError)
        print(f"error: {error}", file=sys.stderr)
        return EXIT_INVALID_ARGUMENT
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _failed_call(error: errors.ExpertError) -> int:
    print(f"error: {error}", file=sys.stderr)
    for field, description in error.field_violations:
        print(f"  {field}: {description}", file=sys.stderr)
    return exit_code_for(error.code)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="expertd", description="Operator commands for an expertd server.")
    add_subcommands(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    return parser


def main(argv: list[str] | None = None) -> int:
    """``expertd <command> ...`` without ``serve``; returns the exit code."""
    args = build_parser().parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
