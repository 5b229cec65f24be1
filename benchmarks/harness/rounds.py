"""Alternation and its arithmetic: sides timed in rounds so a shared machine's drift hits them alike,
and the medians, ranges and ratios over rounds. Plain Python: a zero-argument call blocks until its
work is done (wrap a JAX call in ``jax.block_until_ready``)."""
from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence


def order(names: Sequence, round_index: int) -> list:
    """``names`` in round ``round_index``'s order: as given on even rounds, reversed on odd ones (so
    no side always runs first, or right after the same other)."""
    return list(names) if round_index % 2 == 0 else list(names)[::-1]


def alternate(rounds: int, *choices: Iterable) -> Iterator[tuple]:
    """``(round_index, *choice)`` for every combination of ``choices`` in each of ``rounds`` rounds:
    every side once a round, the rounds one after the other."""
    combos = list(itertools.product(*choices))
    for round_index in range(rounds):
        for combo in combos:
            yield (round_index, *combo)


def timed(call: Callable[[], object]) -> float:
    """Seconds one call of ``call`` takes."""
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


@dataclasses.dataclass
class Timing:
    """The timed calls' seconds; the warm-up call's seconds (compilation included; not a sample)
    and its result."""

    samples: list[float]
    first_s: float
    output: object = None

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


def time_calls(call: Callable[[], object], *, min_calls: int = 3, max_calls: int | None = None,
               budget_s: float = 0.0) -> Timing:
    """One warm-up call, then timed calls: at least ``min_calls``, and more while they add up to
    less than ``budget_s`` and are fewer than ``max_calls`` (default ``min_calls``)."""
    start = time.perf_counter()
    output = call()
    first = time.perf_counter() - start
    samples: list[float] = []
    most = min_calls if max_calls is None else max_calls
    while len(samples) < min_calls or (len(samples) < most and sum(samples) < budget_s):
        samples.append(timed(call))
    return Timing(samples, first, output)


def interleaved_medians(calls: dict[str, Callable[[], object]], budget_s: float = 8.0, min_rounds: int = 5,
                        max_rounds: int = 15) -> dict[str, float]:
    """Median seconds of each zero-argument call in ``calls``, timed in rounds that call each once
    (``order``: reversed every other round), at least ``min_rounds``, then until ``budget_s`` is
    spent or ``max_rounds`` are run."""
    times = {name: [] for name in calls}
    spent = 0.0
    for round_index in range(max_rounds):
        if round_index >= min_rounds and spent >= budget_s:
            break
        for name in order(calls, round_index):
            times[name].append(timed(calls[name]))
            spent += times[name][-1]
    return {name: statistics.median(t) for name, t in times.items()}


def ratios(samples: Sequence[float], baseline: Sequence[float]) -> list[float]:
    """Each round's sample over the baseline's sample of the same round."""
    return [s / b for s, b in zip(samples, baseline)]


def median_ratio(samples: Sequence[float], baseline: Sequence[float]) -> float:
    """The median over rounds of ``ratios``: the ratio a drifting machine leaves least room to bend."""
    return statistics.median(ratios(samples, baseline))


def span(values: Iterable[float], digits: int = 2, collapse: bool = True) -> str:
    """``"low-high"`` of ``values`` at ``digits`` decimals (one number where both print alike and
    ``collapse``)."""
    values = list(values)
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return low if collapse and low == high else f"{low}-{high}"


def spread(values: Iterable[float]) -> str:
    """``"median (min-max)"`` of a list of ratios."""
    values = list(values)
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"
