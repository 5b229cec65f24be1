"""Expert-parallel load balancing (EPLB): where the E logical experts of a layer live on the
P = E + N physical expert slots of R ranks, planned on the host from an observed load.

Terms (as vLLM, SGLang and DeepSeek's EPLB use them): a *logical* expert is one of the model's E
experts; a *physical* expert (a slot) is one copy of a logical expert's weights on one rank. Every
rank holds S = P / R slots; N = P - E slots are *redundant*: extra replicas of the hottest
experts, so that their tokens can be split between ranks. Slot ids are rank-major: slot s of rank
r is physical expert p = r * S + s.

Public API (numpy, host side; nothing here runs on a device):

  Placement(physical_to_logical int [R, S], num_logical=E)
      The typed placement (validated: every logical expert has at least one replica). Derived,
      read-only: replica_counts int32 [E], logical_to_physical int32 [E, N + 1] (each expert's
      slots ascending, -1 past its count), tables() (what the EP layer reads at run time),
      rank_loads(load [E]) -> float64 [R] and balancedness(load) = mean / max of the rank loads
      (1.0 is perfectly even; each replica is assumed to take an equal share of its expert's
      tokens, which is how the EP layer splits them). Placement.identity(E, R): expert e on rank
      e // (E / R), no redundancy.

  plan_placement(load [E], num_ranks, num_redundant, *, num_groups=None, num_nodes=1) -> Placement
      DeepSeek's EPLB policy, re-implemented: hierarchical when the layer has expert groups and
      the node count divides them (groups packed onto nodes, then replication and packing inside
      each node, so a group's experts never leave its node), global otherwise (replicate over the
      whole mesh, then pack). Replication gives each redundant slot, one at a time, to the expert
      with the highest load per replica; packing puts the heaviest physical experts first onto the
      lightest rank that still has a free slot, preferring ranks that do not yet hold a replica of
      the same expert. Slots inside a rank are ordered by logical id. Deterministic: ties go to
      the lowest index.

  balanced_packing(weights [n], num_packs, labels=None) -> (pack int64 [n], position int64 [n])
  replicate(load [E], num_physical) -> (physical_to_logical int64 [P], replica_counts int64 [E])
      the two steps plan_placement is made of.
"""
from __future__ import annotations

import dataclasses
import heapq
from typing import NamedTuple

import numpy as np


class PlacementTables(NamedTuple):
    """What the expert-parallel layer reads at run time to route a token to a replica (E logical
    experts, N redundant slots; arrays of a fixed shape for a given (E, N), so that swapping one
    placement for another never recompiles a step).

    replicas: int32 [E, N + 1] each expert's physical slots, ascending; columns past its count
              repeat its first slot (never read: the layer picks column `token % count`)
    counts:   int32 [E] replicas of each expert (>= 1)
    """

    replicas: np.ndarray
    counts: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
    """E logical experts on R ranks of S slots each (see the module docstring).

    Attributes:
      physical_to_logical: int32 [R, S], the logical expert held by each slot (read-only).
      num_logical: E.
    """

    physical_to_logical: np.ndarray
    num_logical: int

    def __post_init__(self):
        table = np.array(self.physical_to_logical, copy=True)
        if table.ndim != 2 or table.shape[0] < 1 or table.shape[1] < 1:
            raise ValueError(f"physical_to_logical must be [num_ranks, slots_per_rank], got shape {table.shape}")
        if not np.issubdtype(table.dtype, np.integer):
            raise ValueError(f"physical_to_logical must hold integer expert ids, got {table.dtype}")
        e = self.num_logical
        if not isinstance(e, (int, np.integer)) or isinstance(e, bool) or e < 1:
            raise ValueError(f"num_logical must be an int >= 1, got {e!r}")
        if table.min() < 0 or table.max() >= e:
            raise ValueError(f"physical_to_logical holds ids outside [0, {e}): min {table.min()}, max {table.max()}")
        counts = np.bincount(table.reshape(-1), minlength=e)
        if (counts == 0).any():
            raise ValueError(f"every logical expert needs at least one slot; experts {np.flatnonzero(counts == 0)[:8]} "
                             "have none")
        table = table.astype(np.int32)
        table.flags.writeable = False
        object.__setattr__(self, "physical_to_logical", table)
        object.__setattr__(self, "num_logical", int(e))

    # -- shape -------------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return self.physical_to_logical.shape[0]

    @property
    def slots_per_rank(self) -> int:
        return self.physical_to_logical.shape[1]

    @property
    def num_physical(self) -> int:
        return self.physical_to_logical.size

    @property
    def num_redundant(self) -> int:
        return self.num_physical - self.num_logical

    # -- derived maps --------------------------------------------------------------------------
    @property
    def replica_counts(self) -> np.ndarray:
        """int32 [E]: slots holding each logical expert."""
        return np.bincount(self.physical_to_logical.reshape(-1), minlength=self.num_logical).astype(np.int32)

    @property
    def logical_to_physical(self) -> np.ndarray:
        """int32 [E, N + 1]: each logical expert's slots (rank-major ids), ascending, -1 past its count."""
        flat = self.physical_to_logical.reshape(-1)
        order = np.argsort(flat, kind="stable")  # slots grouped by expert, ascending inside a group
        counts = self.replica_counts
        starts = np.cumsum(counts) - counts
        out = np.full((self.num_logical, self.num_redundant + 1), -1, np.int32)
        column = np.arange(flat.size) - np.repeat(starts, counts)
        out[flat[order], column] = order
        return out

    def tables(self) -> PlacementTables:
        """The run-time tables of the EP layer (see PlacementTables)."""
        replicas = self.logical_to_physical
        replicas = np.where(replicas >= 0, replicas, replicas[:, :1]).astype(np.int32)
        return PlacementTables(replicas, self.replica_counts)

    @property
    def is_identity(self) -> bool:
        """No redundancy and expert e on slot e (the layout without a placement)."""
        flat = self.physical_to_logical.reshape(-1)
        return self.num_redundant == 0 and bool((flat == np.arange(self.num_logical)).all())

    # -- load ----------------------------------------------------------------------------------
    def rank_loads(self, load) -> np.ndarray:
        """float64 [R]: the tokens each rank would run for a per-expert `load [E]`, each replica
        taking an equal share of its expert's tokens."""
        load = _check_load(load, self.num_logical)
        per_slot = (load / self.replica_counts)[self.physical_to_logical]
        return per_slot.sum(axis=1)

    def balancedness(self, load) -> float:
        """mean / max of `rank_loads(load)`: 1.0 when even (or no load), 1 / R when one rank does all."""
        ranks = self.rank_loads(load)
        peak = ranks.max()
        return float(ranks.mean() / peak) if peak > 0 else 1.0

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def identity(cls, num_logical: int, num_ranks: int) -> Placement:
        """Expert e on slot e (rank e // (E / R)); E must be divisible by R."""
        if num_ranks < 1 or num_logical % num_ranks:
            raise ValueError(f"num_logical={num_logical} must be divisible by num_ranks={num_ranks}")
        return cls(np.arange(num_logical).reshape(num_ranks, -1), num_logical)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        return self.num_logical == other.num_logical and np.array_equal(self.physical_to_logical,
                                                                        other.physical_to_logical)

    def __hash__(self) -> int:
        return hash((self.num_logical, self.physical_to_logical.shape, self.physical_to_logical.tobytes()))

    def __repr__(self) -> str:
        return (f"Placement(E={self.num_logical}, ranks={self.num_ranks}, slots_per_rank={self.slots_per_rank}, "
                f"redundant={self.num_redundant}, max_replicas={int(self.replica_counts.max())})")


def _check_load(load, num_logical: int) -> np.ndarray:
    load = np.asarray(load, np.float64)
    if load.shape != (num_logical,):
        raise ValueError(f"load must be [E={num_logical}] tokens per logical expert, got shape {load.shape}")
    if not np.isfinite(load).all() or (load < 0).any():
        raise ValueError("load must hold finite, non-negative token counts")
    return load


def balanced_packing(weights, num_packs: int, labels=None) -> tuple[np.ndarray, np.ndarray]:
    """Pack n weighted items into `num_packs` packs of exactly n / num_packs items each, keeping the
    pack weights as even as the greedy rule can: heaviest item first, onto the lightest pack that
    has room (ties: lowest pack index). With `labels` (int [n]), a pack already holding an item of
    the same label is avoided while another pack has room.

    Returns (pack int64 [n], position int64 [n]): each item's pack and its place in the pack
    (the order it arrived there).
    """
    weights = np.asarray(weights, np.float64)
    n = weights.shape[0]
    if num_packs < 1 or n % num_packs:
        raise ValueError(f"{n} items cannot fill {num_packs} packs equally")
    per_pack = n // num_packs
    pack = np.empty(n, np.int64)
    position = np.empty(n, np.int64)
    loads = np.zeros(num_packs)
    sizes = np.zeros(num_packs, np.int64)
    held: list[set] = [set() for _ in range(num_packs)]
    for item in np.argsort(-weights, kind="stable"):
        room = sizes < per_pack
        if labels is not None:
            fresh = room & np.array([labels[item] not in h for h in held])
            if fresh.any():
                room = fresh
        choice = int(np.flatnonzero(room)[np.argmin(loads[room])])
        pack[item], position[item] = choice, sizes[choice]
        loads[choice] += weights[item]
        sizes[choice] += 1
        if labels is not None:
            held[choice].add(labels[item])
    return pack, position


def replicate(load, num_physical: int) -> tuple[np.ndarray, np.ndarray]:
    """Spread E logical experts over `num_physical` >= E slots: one each, then every extra slot to
    the expert with the highest load per replica (ties: lowest id). Returns (physical_to_logical
    int64 [P]: experts 0..E-1 first, then the extra replicas in the order given; replica_counts
    int64 [E])."""
    load = np.asarray(load, np.float64)
    e = load.shape[0]
    if num_physical < e:
        raise ValueError(f"num_physical={num_physical} must be >= the {e} logical experts")
    counts = np.ones(e, np.int64)
    heap = [(-load[i], i) for i in range(e)]
    heapq.heapify(heap)
    extra = []
    for _ in range(num_physical - e):
        _, i = heapq.heappop(heap)
        extra.append(i)
        counts[i] += 1
        heapq.heappush(heap, (-load[i] / counts[i], i))
    return np.concatenate([np.arange(e), np.asarray(extra, np.int64)]).astype(np.int64), counts


def _place(load, num_physical: int, num_ranks: int) -> np.ndarray:
    """Global policy over `num_ranks` ranks: replicate, then pack; returns logical ids [R, S]."""
    physical, counts = replicate(load, num_physical)
    share = load[physical] / counts[physical]
    pack, position = balanced_packing(share, num_ranks, labels=physical)
    table = np.empty((num_ranks, num_physical // num_ranks), np.int64)
    table[pack, position] = physical
    return np.sort(table, axis=1)


def plan_placement(load, num_ranks: int, num_redundant: int, *, num_groups: int | None = None,
                   num_nodes: int = 1) -> Placement:
    """A Placement of `load [E]` (tokens per logical expert) onto `num_ranks` ranks with
    `num_redundant` extra slots; see the module docstring for the policy.

    (E + num_redundant) must be divisible by num_ranks. The hierarchical policy applies when
    num_groups (the layer's expert groups) and num_nodes > 1 are given, num_nodes divides
    num_groups and num_ranks, and the slots divide evenly over the nodes; otherwise global.
    """
    load = np.asarray(load, np.float64)
    if load.ndim != 1 or load.size < 1:
        raise ValueError(f"load must be [E] tokens per logical expert, got shape {load.shape}")
    e = load.size
    load = _check_load(load, e)
    if isinstance(num_redundant, bool) or not isinstance(num_redundant, (int, np.integer)) or num_redundant < 0:
        raise ValueError(f"num_redundant must be an int >= 0, got {num_redundant!r}")
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, (int, np.integer)) or num_ranks < 1:
        raise ValueError(f"num_ranks must be an int >= 1, got {num_ranks!r}")
    physical = e + int(num_redundant)
    if physical % num_ranks:
        raise ValueError(f"E + num_redundant = {e} + {num_redundant} = {physical} slots must be divisible by the "
                         f"{num_ranks} ranks")
    hierarchical = (num_groups is not None and num_nodes > 1 and e % num_groups == 0 and num_groups % num_nodes == 0
                    and num_ranks % num_nodes == 0 and physical % num_nodes == 0 and e % num_nodes == 0
                    and (physical // num_nodes) % (num_ranks // num_nodes) == 0)
    if not hierarchical:
        return Placement(_place(load, physical, num_ranks), e)
    group_size = e // num_groups
    node_of_group, _ = balanced_packing(load.reshape(num_groups, group_size).sum(axis=1), num_nodes)
    ranks_per_node = num_ranks // num_nodes
    tables = []
    for node in range(num_nodes):
        experts = np.concatenate([np.arange(g * group_size, (g + 1) * group_size)
                                  for g in np.flatnonzero(node_of_group == node)])
        local = _place(load[experts], physical // num_nodes, ranks_per_node)
        tables.append(experts[local])
    return Placement(np.concatenate(tables), e)
