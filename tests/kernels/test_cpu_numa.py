"""NUMA placement (kernels/cpu/numa.py) against faked sysfs trees: a 2-socket host, a host with a
memory-only node, a process confined to some CPUs; and on this host, pinning a thread and binding
an array's pages to node 0."""
import os
import threading

import numpy as np
import pytest

from expertd.kernels.cpu import numa


def fake_sysfs(root, nodes):
    """nodes: {id: (cpulist text, MemTotal kB)} as /sys/devices/system/node lays them out."""
    for node_id, (cpulist, kb) in nodes.items():
        d = root / f"node{node_id}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")
        (d / "meminfo").write_text(f"Node {node_id} MemTotal:       {kb} kB\nNode {node_id} MemFree: 1 kB\n")
    (root / "online").write_text(f"0-{len(nodes) - 1}\n")  # not a node directory
    return root


def test_parse_cpulist():
    assert numa.parse_cpulist("0-3,8-11\n") == (0, 1, 2, 3, 8, 9, 10, 11)
    assert numa.parse_cpulist("5") == (5,) and numa.parse_cpulist("\n") == ()


def test_two_socket_host_gets_half_of_every_expert_per_socket(tmp_path):
    root = fake_sysfs(tmp_path, {0: ("0-31,64-95", 256 << 20), 1: ("32-63,96-127", 256 << 20)})
    topo = numa.read_topology(root, allowed=range(128))
    assert [n.id for n in topo.nodes] == [0, 1] and topo.cpus == 128
    assert topo.nodes[1].cpus[:2] == (32, 33) and topo.nodes[0].memory_bytes == 256 << 30
    for intermediate, half in ((768, 384), (2880, 1408)):  # Qwen3-30B-A3B, gpt-oss (22 of its 45 panels)
        plan = numa.plan_placement(topo, intermediate)
        assert [(s.node, s.i0, s.i1, s.threads) for s in plan.shares] == [(0, 0, half, 64), (1, half, intermediate, 64)]
        assert plan.reductions == 1 and plan.threads == 128
    assert numa.summary(numa.plan_placement(topo, 768)) == ("2 nodes: node 0 (64 CPUs) columns 0-383, node 1 (64 CPUs) "
                                                           "columns 384-767; partial sums added once (1 reduction)")


def test_memory_only_nodes_and_confined_processes(tmp_path):
    root = fake_sysfs(tmp_path, {0: ("0-7", 1 << 20), 1: ("8-11", 1 << 20), 2: ("", 4 << 20)})  # node 2: CXL memory
    topo = numa.read_topology(root, allowed=range(12))
    plan = numa.plan_placement(topo, 768)
    assert [(s.node, s.i0, s.i1) for s in plan.shares] == [(0, 0, 512), (1, 512, 768)]  # 8 : 4 CPUs
    confined = numa.read_topology(root, allowed={8, 9, 10})  # e.g. taskset: node 1's CPUs only
    assert [(s.node, s.i0, s.i1, s.cpus) for s in numa.plan_placement(confined, 100).shares] == \
        [(1, 0, 100, (8, 9, 10))]
    with pytest.raises(ValueError, match="no node has a CPU"):
        numa.plan_placement(numa.read_topology(root, allowed={99}), 768)
    # No sysfs tree: one node with the allowed CPUs.
    assert numa.read_topology(tmp_path / "missing", allowed={0, 1}).nodes == (numa.Node(0, (0, 1), 0),)


def test_this_host_plan_pin_and_bind():
    topo = numa.read_topology()
    plan = numa.plan_placement(topo, 768)
    assert plan.shares[0].i0 == 0 and plan.shares[-1].i1 == 768 and plan.threads == len(os.sched_getaffinity(0))
    assert numa.summary(plan).startswith(f"{len(plan.shares)} node")
    before = os.sched_getaffinity(0)
    seen = {}

    def pinned():
        numa.pin_current_thread({min(before)})
        seen["cpus"] = os.sched_getaffinity(0)
    thread = threading.Thread(target=pinned)
    thread.start()
    thread.join()
    assert seen["cpus"] == {min(before)} and os.sched_getaffinity(0) == before  # that thread only
    weights = np.ones(1 << 20, np.int8)
    assert numa.bind_memory(weights, topo.nodes[0].id) in (True, False)  # containers may refuse mbind
    assert weights.sum() == 1 << 20
