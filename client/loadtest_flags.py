"""The flags of ``expertd loadtest`` and the LoadTestConfig they make (expertd.client.cli runs it)."""
from __future__ import annotations

from expertd.client import loadtest


def _float_list(text: str, flag: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated numbers, got {text!r}") from None


def add_arguments(parser) -> None:
    """The ``expertd loadtest`` flags (the connection flags come from expertd.client.cli)."""
    parser.add_argument("--layer", type=int, default=0, help="layer to load (default 0)")
    parser.add_argument("--protocol", choices=("expertd", "kserve"), default="expertd",
                        help="expertd.v1 Forward or KServe v2 ModelInfer")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", help="closed loop: comma-separated numbers of requests in flight (default 1)")
    load.add_argument("--rate", help="open loop: comma-separated target request rates (req/s, Poisson arrivals)")
    parser.add_argument("--duration", type=float, help="measured seconds per step (default 5 unless --requests)")
    parser.add_argument("--requests", type=int,
                        help="measured requests per step (with --duration: whichever comes first)")
    parser.add_argument("--warmup", type=float, default=1.0,
                        help="seconds of load before each measured phase, not counted (default 1)")
    parser.add_argument("--tokens", default="16",
                        help="tokens per request: N, LOW-HIGH (uniform) or N1,N2,... (default 16)")
    parser.add_argument("--dtype", choices=tuple(loadtest.DTYPES), default="bfloat16",
                        help="dtype of the hidden states sent (default bfloat16)")
    parser.add_argument("--max-seconds", type=float, default=600.0,
                        help="hard limit per step; requests still in flight then count as CANCELLED")
    parser.add_argument("--max-inflight", type=int, default=1024,
                        help="open loop: most requests in flight at once (default 1024)")
    parser.add_argument("--seed", type=int, default=0, help="seed of inputs, token counts and arrivals")
    parser.add_argument("--retries", type=int, default=0,
                        help="retry UNAVAILABLE (on another replica) and RESOURCE_EXHAUSTED like the client does "
                             "(default 0: every failure is counted)")
    parser.add_argument("--json", nargs="?", const="-", metavar="PATH",
                        help="write the report as JSON to PATH (no PATH: print it instead of the table)")
    parser.add_argument("--plot", metavar="PNG", help="write latency against throughput to this PNG (needs matplotlib)")
    progress = parser.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_true", default=None,
                          help="show a progress bar (default: when stderr is a terminal)")
    progress.add_argument("--no-progress", dest="progress", action="store_false")


def config_from(args, *, tls=False) -> loadtest.LoadTestConfig:
    """A LoadTestConfig from parsed ``expertd loadtest`` flags (ValueError naming the bad flag)."""
    rates = _float_list(args.rate, "--rate") if args.rate else ()
    try:
        concurrency = () if rates else tuple(int(c) for c in (args.concurrency or "1").split(","))
    except ValueError:
        raise ValueError(f"--concurrency: expected comma-separated integers, got {args.concurrency!r}") from None
    duration = args.duration if args.duration is not None or args.requests is not None else 5.0
    return loadtest.LoadTestConfig(
        target=args.target,
        layer=args.layer,
        protocol=args.protocol,
        concurrency=concurrency,
        rates=rates,
        duration=duration,
        requests=args.requests,
        warmup=args.warmup,
        tokens=loadtest.TokenDistribution.parse(args.tokens),
        dtype=args.dtype,
        timeout=args.timeout,
        max_seconds=args.max_seconds,
        max_inflight=args.max_inflight,
        seed=args.seed,
        tls=tls,
        token=args.token,
        retries=args.retries,
    )
