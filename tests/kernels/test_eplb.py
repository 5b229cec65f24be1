"""EPLB placement planning (expertd.kernels.eplb): the Placement type's invariants and the planner's
balance on skewed loads, hierarchical and global. Host-side numpy only."""
import numpy as np
import pytest

from expertd.kernels import ep, eplb


def zipf_load(num_experts, exponent=1.0, seed=0, tokens=100_000):
    """Tokens per expert with Zipf-like popularity (rank^-exponent), shuffled over the expert ids."""
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, num_experts + 1) ** exponent
    rng.shuffle(popularity)
    return np.round(popularity / popularity.sum() * tokens)


def check_invariants(placement, num_logical, num_ranks, num_redundant):
    table = placement.physical_to_logical
    assert table.shape == (num_ranks, (num_logical + num_redundant) // num_ranks)  # equal slots per rank
    assert table.dtype == np.int32 and not table.flags.writeable
    counts = placement.replica_counts
    assert (counts >= 1).all() and counts.sum() == num_logical + num_redundant
    np.testing.assert_array_equal(counts, np.bincount(table.reshape(-1), minlength=num_logical))
    replicas = placement.logical_to_physical
    assert replicas.shape == (num_logical, num_redundant + 1)
    for e in range(num_logical):
        slots = replicas[e][: counts[e]]
        assert (replicas[e][counts[e]:] == -1).all()
        assert (np.diff(slots) > 0).all() and (table.reshape(-1)[slots] == e).all()
    tables = placement.tables()
    assert tables.replicas.shape == (num_logical, num_redundant + 1) and (tables.replicas >= 0).all()
    assert (table.reshape(-1)[tables.replicas] == np.arange(num_logical)[:, None]).all()
    assert (np.diff(table, axis=1) >= 0).all()  # slots inside a rank ordered by expert id


@pytest.mark.parametrize("num_logical,num_ranks,num_redundant", [(8, 4, 0), (8, 4, 4), (64, 8, 8), (256, 8, 32),
                                                                 (60, 8, 4), (16, 16, 16)])
def test_plans_keep_the_invariants_and_balance_zipf_loads(num_logical, num_ranks, num_redundant):
    load = zipf_load(num_logical, seed=num_logical + num_redundant)
    placement = eplb.plan_placement(load, num_ranks, num_redundant)
    check_invariants(placement, num_logical, num_ranks, num_redundant)
    assert placement.num_redundant == num_redundant and placement.num_physical == num_logical + num_redundant
    ranks = placement.rank_loads(load)
    np.testing.assert_allclose(ranks.sum(), load.sum())
    # No placement can do better than the mean rank load or an expert's share over its replicas.
    bound = max(load.sum() / num_ranks, (load / placement.replica_counts).max())
    assert ranks.max() >= bound - 1e-6
    if num_logical % num_ranks == 0:  # never worse than the plain layout
        assert placement.balancedness(load) >= eplb.Placement.identity(num_logical, num_ranks).balancedness(load)


def test_redundant_experts_at_e_over_8_balance_a_zipf_trace_to_within_15_percent():
    """The issue's goal: max/mean rank load <= 1.15 with E/8 redundant slots, on a Zipf-like
    popularity whose plain layout runs at max/mean ~2 (DeepSeek-V3's 256 experts on 8 ranks)."""
    e, r = 256, 8
    load = zipf_load(e, exponent=1.2, seed=3)
    before = 1 / eplb.Placement.identity(e, r).balancedness(load)
    after = 1 / eplb.plan_placement(load, r, e // 8).balancedness(load)
    assert before > 1.5 and after <= 1.15, (before, after)
    # the hottest experts got the replicas
    placement = eplb.plan_placement(load, r, e // 8)
    hottest = np.argsort(-load)[:4]
    assert (placement.replica_counts[hottest] > 1).all()


def test_replicate_gives_each_slot_to_the_highest_load_per_replica():
    physical, counts = eplb.replicate(np.array([10.0, 1.0, 4.0]), 6)
    # 10 -> split (5), then 5 vs 4 -> 0 again (3.33), then 4 -> 2 (2): counts [3, 1, 2]
    np.testing.assert_array_equal(counts, [3, 1, 2])
    np.testing.assert_array_equal(physical, [0, 1, 2, 0, 0, 2])
    with pytest.raises(ValueError, match="must be >= the 3 logical experts"):
        eplb.replicate(np.ones(3), 2)


def test_balanced_packing_fills_every_pack_equally_heaviest_first():
    pack, position = eplb.balanced_packing(np.array([9.0, 1.0, 8.0, 2.0, 5.0, 5.0]), 2)
    assert np.bincount(pack).tolist() == [3, 3]
    loads = np.bincount(pack, weights=[9, 1, 8, 2, 5, 5])
    assert loads.max() - loads.min() <= 2
    assert position[0] == 0 and position[2] == 0  # the two heaviest open the two packs
    # with labels, a second copy of label 7 avoids the pack that holds the first
    pack, _ = eplb.balanced_packing(np.array([4.0, 4.0, 1.0, 1.0]), 2, labels=[7, 7, 1, 2])
    assert pack[0] != pack[1]
    with pytest.raises(ValueError, match="cannot fill 4 packs"):
        eplb.balanced_packing(np.ones(6), 4)


def test_hierarchical_policy_keeps_groups_and_their_replicas_on_one_node():
    e, groups, nodes, r, n = 64, 8, 2, 8, 8
    load = zipf_load(e, seed=7)
    placement = eplb.plan_placement(load, r, n, num_groups=groups, num_nodes=nodes)
    check_invariants(placement, e, r, n)
    node_of_slot = np.repeat(np.arange(nodes), r // nodes * placement.slots_per_rank)
    flat = placement.physical_to_logical.reshape(-1)
    for g in range(groups):  # every slot of a group's experts sits on one node
        assert len(set(node_of_slot[(flat // (e // groups)) == g])) == 1
    # each node holds half the groups and half the slots
    assert (np.bincount(node_of_slot) == placement.num_physical // nodes).all()
    # global policy when the node count does not divide the groups, or with one node
    for kwargs in (dict(num_groups=6, num_nodes=4), dict(num_groups=groups, num_nodes=1)):
        load48 = zipf_load(48, seed=1)
        np.testing.assert_array_equal(eplb.plan_placement(load48, r, 8, **kwargs).physical_to_logical,
                                      eplb.plan_placement(load48, r, 8).physical_to_logical)


def test_plans_are_deterministic_and_a_uniform_load_without_redundancy_stays_even():
    load = zipf_load(32, seed=2)
    assert eplb.plan_placement(load, 4, 4) == eplb.plan_placement(load.copy(), 4, 4)
    assert hash(eplb.plan_placement(load, 4, 4)) == hash(eplb.plan_placement(load, 4, 4))
    even = eplb.plan_placement(np.ones(32), 4, 0)
    assert even.balancedness(np.ones(32)) == 1.0
    assert ep.plan_placement is eplb.plan_placement  # the EP layer's door to the planner


def test_identity_and_rank_loads():
    placement = eplb.Placement.identity(8, 4)
    assert placement.is_identity and placement.slots_per_rank == 2 and placement.num_redundant == 0
    np.testing.assert_array_equal(placement.rank_loads(np.arange(8.0)), [1, 5, 9, 13])
    assert placement.balancedness(np.zeros(8)) == 1.0
    np.testing.assert_allclose(placement.balancedness(np.arange(8.0)), 7 / 13)
    # a replicated expert's load splits evenly between its replicas
    two = eplb.Placement(np.array([[0, 1], [0, 2]]), 3)
    np.testing.assert_array_equal(two.rank_loads(np.array([10.0, 1.0, 3.0])), [6.0, 8.0])
    assert not two.is_identity and two.num_redundant == 1


@pytest.mark.parametrize("table,num_logical,match", [
    (np.array([0, 1, 2]), 3, "must be \\[num_ranks, slots_per_rank\\]"),
    (np.array([[0, 1], [3, 2]]), 3, "ids outside \\[0, 3\\)"),
    (np.array([[0, 1], [1, 0]]), 3, "experts \\[2\\] have none"),
    (np.array([[0.0, 1.0]]), 2, "integer expert ids"),
    (np.array([[0, 1]]), 0, "num_logical must be an int >= 1"),
])
def test_bad_placements_are_refused_naming_the_problem(table, num_logical, match):
    with pytest.raises(ValueError, match=match):
        eplb.Placement(table, num_logical)


def test_bad_planning_arguments_are_refused():
    with pytest.raises(ValueError, match="10 slots must be divisible by the 4 ranks"):
        eplb.plan_placement(np.ones(8), 4, 2)
    with pytest.raises(ValueError, match="load must hold finite, non-negative"):
        eplb.plan_placement(np.array([1.0, -1.0]), 2, 0)
    with pytest.raises(ValueError, match="num_redundant must be an int >= 0"):
        eplb.plan_placement(np.ones(8), 4, -4)
    with pytest.raises(ValueError, match="load must be \\[E\\]"):
        eplb.plan_placement(np.ones((2, 4)), 4, 0)
    with pytest.raises(ValueError, match="load must be \\[E=8\\]"):
        eplb.Placement.identity(8, 4).rank_loads(np.ones(4))
