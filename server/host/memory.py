"""Transparent huge pages for weights held in host memory (arrays on JAX's CPU devices).

Decode-size batches stream every touched expert matrix from DRAM once per call, so their speed is
the machine's read rate. XLA:CPU allocates with malloc, on 4 KiB pages (where THP is in "madvise"
mode, the common default); on 2 MiB pages the same reads need 512x fewer TLB entries and page
walks (what that is worth: BENCHMARKS.md). numpy does the same for its own large arrays; torch has
THP_MEM_ALLOC_ENABLE.

`advise_huge_pages(arrays)` marks the 2 MiB-aligned interior of every CPU buffer MADV_HUGEPAGE and
asks the kernel to collapse it now (MADV_COLLAPSE, Linux 6.1+; its time per GB is in the report),
once at load, rather than leaving it to khugepaged's slow background scan. Neither call changes the data;
the buffers stay XLA's. Where it cannot apply (not Linux, THP "never", GPU arrays) it does
nothing, and without MADV_COLLAPSE (Linux < 6.1) it only marks the ranges; the report says why.
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import pathlib
import re
import sys
import time
from collections.abc import Iterable

import jax

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
COLLAPSE_TRIES = 2
THP_SETTING = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


@dataclasses.dataclass(frozen=True)
class HugePageReport:
    """What `advise_huge_pages` did: `eligible_bytes` lie in 2 MiB-aligned ranges of the arrays'
    buffers, `huge_bytes` of them are on huge pages afterwards (the pages MADV_COLLAPSE collapsed;
    before Linux 6.1, what /proc/self/smaps shows for the mappings holding them, which may count
    neighbours too); `reason` says why they were not (all) collapsed now, else None;
    `collapse_errors` counts the 2 MiB pages MADV_COLLAPSE could not collapse (no free huge page
    there; khugepaged may do it later)."""
    eligible_bytes: int = 0
    huge_bytes: int = 0
    seconds: float = 0.0
    collapse_errors: int = 0
    reason: str | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def summary(report: dict) -> str:
    """One line for logs and `expertd serve`: "A of B MiB on huge pages (S s)[; why not all]"."""
    mib = 1 << 20
    line = (f"{report['huge_bytes'] / mib:.0f} of {report['eligible_bytes'] / mib:.0f} MiB on huge pages "
            f"({report['seconds']:.2f}s)")
    return line + (f"; {report['reason']}" if report["reason"] else "")


def note(report: dict | None) -> str | None:
    """The start-up line about the weights' pages (``HugePageReport.as_dict()``); None without a
    report (not on CPU, or huge pages off) or without weights big enough for a huge page."""
    if not report or not report["eligible_bytes"]:
        return None
    return "weights: " + summary(report)


def thp_setting() -> str | None:
    """The system's THP mode ("always", "madvise", "never"), None where unknown (not Linux)."""
    try:
        match = re.search(r"\[(\w+)\]", THP_SETTING.read_text())
    except OSError:
        return None
    return match.group(1) if match else None


def cpu_buffer_ranges(arrays: Iterable) -> list[tuple[int, int]]:
    """[(address, nbytes)] of the buffers of every shard of `arrays` that lives on a CPU device."""
    ranges = []
    for array in arrays:
        for shard in getattr(array, "addressable_shards", ()):
            if shard.device.platform == "cpu" and shard.data.nbytes:
                ranges.append((shard.data.unsafe_buffer_pointer(), shard.data.nbytes))
    return ranges


def aligned_interior(address: int, nbytes: int) -> tuple[int, int] | None:
    """The largest [start, end) inside [address, address + nbytes) on 2 MiB boundaries, or None."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    return (start, end) if end > start else None


def advise_huge_pages(arrays: Iterable) -> HugePageReport:
    """Back the CPU buffers of `arrays` (jax.Arrays) with huge pages where the system allows.
    Waits for the arrays first: MADV_COLLAPSE fails on pages XLA has not written yet."""
    arrays = jax.block_until_ready(list(arrays))
    ranges = [r for a in cpu_buffer_ranges(arrays) if (r := aligned_interior(*a))]
    eligible = _total(ranges)
    if not ranges:
        return HugePageReport(reason="no CPU buffer spans a whole 2 MiB page")
    if not sys.platform.startswith("linux"):
        return HugePageReport(eligible, reason=f"transparent huge pages are Linux-only (this is {sys.platform})")
    setting = thp_setting()
    if setting not in ("always", "madvise"):
        return HugePageReport(eligible, reason=f"transparent huge pages are {setting or 'unavailable'} on this system")
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    start_time = time.perf_counter()
    for start, end in ranges:
        if madvise(start, end - start, MADV_HUGEPAGE) != 0:
            return HugePageReport(eligible, reason=f"madvise(MADV_HUGEPAGE): {os.strerror(ctypes.get_errno())}")
    if kernel_version() < (6, 1):
        return HugePageReport(eligible, huge_bytes=min(eligible, huge_page_bytes(ranges)),
                              seconds=time.perf_counter() - start_time,
                              reason="MADV_COLLAPSE needs Linux 6.1+: left to khugepaged")
    failed = collapse_pages(madvise, ranges)
    return HugePageReport(eligible, huge_bytes=eligible - failed * HUGE_PAGE,
                          seconds=time.perf_counter() - start_time, collapse_errors=failed)


def collapse_pages(madvise, ranges: list[tuple[int, int]]) -> int:
    """MADV_COLLAPSE every 2 MiB page of the aligned `ranges`, one call per page, so the kernel's
    answer says exactly which pages are huge now; a page that fails (EAGAIN / ENOMEM: no free huge
    page) is tried once more. Returns how many pages failed both times.
    (Not from /proc/self/smaps afterwards: it counts per mapping, and the kernel merges a range's
    mapping with neighbours advised earlier, so in CI it read 30 MiB for a 14 MiB range, and once
    2 MiB short of one where every collapse had succeeded.)"""
    pages = [page for start, end in ranges for page in range(start, end, HUGE_PAGE)]
    for _ in range(COLLAPSE_TRIES):
        pages = [page for page in pages if madvise(page, HUGE_PAGE, MADV_COLLAPSE) != 0]
    return len(pages)


def kernel_version() -> tuple[int, ...]:
    """The running Linux kernel's (major, minor), (0,) if unreadable."""
    match = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return (int(match[1]), int(match[2])) if match else (0,)


def huge_page_bytes(ranges: list[tuple[int, int]]) -> int:
    """Bytes of AnonHugePages in this process's mappings that overlap the [start, end) `ranges`,
    from /proc/self/smaps (each mapping counted once, whole: madvise splits mappings at the range
    ends, so a mapping overlapping a range lies inside it unless neighbours merged into it)."""
    total, overlapping = 0, False
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
                if head:
                    low, high = int(head[1], 16), int(head[2], 16)
                    overlapping = any(low < end and start < high for start, end in ranges)
                elif overlapping and line.startswith("AnonHugePages:"):
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total


def _total(ranges: list[tuple[int, int]]) -> int:
    return sum(end - start for start, end in ranges)
