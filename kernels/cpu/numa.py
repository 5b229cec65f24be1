"""NUMA placement for the native CPU experts: the host's nodes, a plan that gives each node its own
share of every expert, and the two calls that carry it out (thread pinning, memory binding).

  read_topology(root="/sys/devices/system/node", allowed=None) -> Topology
      The nodes (`Node`: id, the CPUs this process may run on there, MemTotal bytes) from a sysfs
      tree (`root`; a fake tree in the tests). No such tree (not Linux, a container without
      sysfs): one node 0 holding the allowed CPUs. `allowed` defaults to os.sched_getaffinity(0).
  plan_placement(topology, intermediate, *, align=64) -> Placement
      Which node computes which intermediate columns [i0, i1) of every expert: shares in proportion
      to each node's CPUs, multiples of `align` (the AVX-512 panel width) but the last. Node n holds
      columns [i0, i1) of w_gate and w_up ([E, H, I]) and rows [i0, i1) of w_down ([E, I, H]) in
      its own memory, runs them on its own threads, and yields a partial fp32 [T, H]; the partial
      sums are added once, at the end (one [T, H] per node crosses the interconnect: 8 KiB per token
      at H 2048). Splitting I rather than the experts keeps every node busy whatever the routing
      (a decode step touches few experts; an expert split would idle the nodes whose experts no
      token chose) and reads each touched expert's bytes exactly once in all.
  summary(placement) -> str: one line for a start-up log (the nodes, their CPUs and columns).
  pin_current_thread(cpus) / bind_memory(array, node): sched_setaffinity for the calling thread;
      mbind(MPOL_BIND, MPOL_MF_MOVE) of a host array's pages to one node (Linux; returns False with
      the reason logged where the system refuses).

What this does not do yet: the native kernel's threads are XLA:CPU's intra-op pool, which expertd
does not own, so they cannot be pinned per node, and the layer runs as one program over all nodes.
The plan, the pinning and the binding are built and tested (tests/kernels/test_cpu_numa.py, against
a fake sysfs tree); running one pool per node on its Placement share is the next step. On a
2-socket host (2 nodes of 32 cores, say) the plan gives each socket half of every expert's
intermediate columns (384 of Qwen3-30B-A3B's 768; 1408 and 1472 of gpt-oss's 2880), 32 threads pinned to its
cores, its weights bound to its DRAM, so a decode step reads at both sockets' bandwidth and adds
the two partial [T, H] sums once. On this one-node VM the plan is the whole layer on node 0.
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import pathlib
import re

log = logging.getLogger(__name__)

SYSFS_NODES = pathlib.Path("/sys/devices/system/node")
MPOL_BIND, MPOL_MF_MOVE = 2, 1 << 1  # linux/mempolicy.h
SYS_MBIND_X86_64 = 237


@dataclasses.dataclass(frozen=True)
class Node:
    """One NUMA node: its id, the CPUs of it this process may run on, and its MemTotal in bytes."""

    id: int
    cpus: tuple[int, ...]
    memory_bytes: int


@dataclasses.dataclass(frozen=True)
class Topology:
    nodes: tuple[Node, ...]

    @property
    def cpus(self) -> int:
        return sum(len(node.cpus) for node in self.nodes)


@dataclasses.dataclass(frozen=True)
class Share:
    """What one node computes: intermediate columns [i0, i1) of every expert, on `threads` threads
    pinned to `cpus`, with those columns' weights bound to the node's memory."""

    node: int
    cpus: tuple[int, ...]
    i0: int
    i1: int

    @property
    def threads(self) -> int:
        return len(self.cpus)


@dataclasses.dataclass(frozen=True)
class Placement:
    """The per-node shares of a layer of `intermediate` columns; nodes without CPUs get none.
    `reductions`: the partial [T, H] sums added at the end (one fewer than the shares)."""

    intermediate: int
    shares: tuple[Share, ...]

    @property
    def reductions(self) -> int:
        return max(len(self.shares) - 1, 0)

    @property
    def threads(self) -> int:
        return sum(share.threads for share in self.shares)


def parse_cpulist(text: str) -> tuple[int, ...]:
    """sysfs's list format ("0-3,8-11", "5", "") -> the CPU ids, ascending."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return tuple(sorted(cpus))


def _memtotal(meminfo: pathlib.Path) -> int:
    try:
        found = re.search(r"MemTotal:\s+(\d+)\s*kB", meminfo.read_text())
    except OSError:
        return 0
    return int(found.group(1)) * 1024 if found else 0


def read_topology(root=SYSFS_NODES, allowed=None) -> Topology:
    """The nodes under sysfs `root`, each with its CPUs that are in `allowed` (module docstring)."""
    if allowed is None:  # (no sched_getaffinity off Linux: every CPU)
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    allowed = set(allowed)
    root = pathlib.Path(root)
    dirs = sorted((int(m.group(1)), p) for p in root.glob("node*") if (m := re.fullmatch(r"node(\d+)", p.name)))
    if not dirs:
        return Topology((Node(0, tuple(sorted(allowed)), 0),))
    nodes = []
    for node_id, path in dirs:
        try:
            cpus = parse_cpulist((path / "cpulist").read_text())
        except OSError:
            cpus = ()
        nodes.append(Node(node_id, tuple(c for c in cpus if c in allowed), _memtotal(path / "meminfo")))
    return Topology(tuple(nodes))


def plan_placement(topology: Topology, intermediate: int, *, align: int = 64) -> Placement:
    """Each node with CPUs a share of the `intermediate` columns in proportion to its CPUs, each
    share's start a multiple of `align`; ValueError without any CPU."""
    if intermediate < 1 or align < 1:
        raise ValueError(f"intermediate and align must be >= 1, got {intermediate}, {align}")
    working = [node for node in topology.nodes if node.cpus]
    if not working:
        raise ValueError("no node has a CPU this process may run on")
    total = sum(len(node.cpus) for node in working)
    blocks = -(-intermediate // align)
    shares, cpus_before, start = [], 0, 0
    for node in working:
        cpus_before += len(node.cpus)
        end = min(intermediate, round(blocks * cpus_before / total) * align)
        if end > start:  # a node too small for one block of columns gets none
            shares.append(Share(node.id, node.cpus, start, end))
            start = end
    return Placement(intermediate, tuple(shares))


def summary(placement: Placement) -> str:
    """`placement` as one line: "1 node: node 0 (2 CPUs) columns 0-767", or for several nodes
    each node's CPUs and share, and the one reduction of their partial sums."""
    parts = [f"node {s.node} ({s.threads} CPUs) columns {s.i0}-{s.i1 - 1}" for s in placement.shares]
    nodes = len(placement.shares)
    tail = f"; partial sums added once ({placement.reductions} reduction)" if nodes > 1 else ""
    return f"{nodes} node{'s' if nodes > 1 else ''}: " + ", ".join(parts) + tail


def pin_current_thread(cpus) -> None:
    """Run the calling thread on `cpus` only (Linux sched_setaffinity; pid 0 is the caller)."""
    os.sched_setaffinity(0, set(cpus))


def bind_memory(array, node: int) -> bool:
    """Bind the pages of host array `array` (a numpy array, or anything with the buffer protocol's
    `__array_interface__`) to NUMA node `node`, moving pages already there (mbind MPOL_BIND |
    MPOL_MF_MOVE). The whole pages the array spans are bound, so keep one array per binding (the
    weights are large and page-aligned). False, with the reason logged, where the system refuses."""
    address, _ = array.__array_interface__["data"]
    size = array.nbytes
    page = os.sysconf("SC_PAGE_SIZE")
    start = address // page * page
    length = -(-(address + size - start) // page) * page
    mask = ctypes.c_ulong(1 << node)
    libc = ctypes.CDLL(None, use_errno=True)
    done = libc.syscall(SYS_MBIND_X86_64, ctypes.c_void_p(start), ctypes.c_ulong(length), MPOL_BIND,
                        ctypes.byref(mask), ctypes.c_ulong(64), MPOL_MF_MOVE)
    if done != 0:
        log.warning("mbind to node %d refused: %s", node, os.strerror(ctypes.get_errno()))
        return False
    return True
