"""Results: the JSON file each benchmark writes (to benchmarks/results/ unless told otherwise) and
the plain column table some print."""
from __future__ import annotations

import json
import os
import pathlib
import platform

from harness import machine

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"
"""benchmarks/results/: where the recorded results live."""


def write_json(path, result: dict, *, indent: int = 1, announce: bool = True) -> pathlib.Path:
    """Write ``result`` to ``path`` (its folder made), with ``"host": machine.facts()`` added unless
    it has a "host"; prints "wrote PATH" where ``announce``."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**result, "host": result.get("host") or machine.facts()}, indent=indent) + "\n")
    if announce:
        print(f"wrote {path}")
    return path


def write_results(path, benchmark: str, rows: list, **fields) -> pathlib.Path:
    """Write a benchmark's JSON the kernels' way: ``rows`` and ``fields`` with the date, machine,
    software, the load average now and this process's host_allocator state."""
    import jax

    from expertd.server.host import allocator

    return write_json(path, dict(benchmark=benchmark, date=machine.today(), machine=platform.platform(),
                                 cpu_count=os.cpu_count(), jax=jax.__version__, jaxlib=jax.lib.__version__,
                                 device=jax.default_backend(), load_average_after=os.getloadavg(),
                                 host_allocator=allocator.state().as_dict(), **fields, rows=rows))


def print_table(title: str, rows: list[dict], columns: list[str]) -> None:
    """``rows`` as a right-aligned table of ``columns`` under ``title`` (floats to 4 significant
    digits, "-" where a row has no such column)."""
    print(f"\n{title}")
    text = [[f"{v:.4g}" if isinstance(v, float) else str(v) for v in (row.get(c, "-") for c in columns)]
            for row in rows]
    widths = [max([len(c)] + [len(t[i]) for t in text]) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for t in text:
        print("  ".join(v.rjust(w) for v, w in zip(t, widths)))
