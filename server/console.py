"""What ``expertd serve`` prints on stdout (every process of a multi-host group alike)."""
from __future__ import annotations


def say(message: str) -> None:
    print(f"expertd: {message}", flush=True)


def print_progress(event) -> None:
    """One warm-up line per compiled step (``expertd.server.engine.engine.CompileEvent``)."""
    options = ", ".join(f"{name}={value!r}" for name, value in sorted(event.compiler_options.items()))
    say(f"compiled {event.done}/{event.total}: {event.kind} bucket {event.bucket} for layers "
        f"{','.join(map(str, event.layers))} in {event.seconds:.2f}s"
        + (f" (experts: {event.expert_backend})" if event.expert_backend else "")
        + (f" (XLA options: {options})" if options else ""))
