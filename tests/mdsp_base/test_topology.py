"""Rank placement from the environment, and level groups cut from (possibly strided) parent groups."""

import pytest
import torch.distributed as dist

from mdsp_base.section import ConfigError
from mdsp_base.topology import (
    GroupKind,
    Topology,
    TopologyConfig,
    all_level_groups,
    check_rank_aligned,
    detect_topology,
    level_members,
    partition_of,
)


def test_slurm_variables_on_frontier_give_gcd_pairs():
    env = {
        "SLURM_CLUSTER_NAME": "frontier",
        "SLURM_NTASKS": "16",
        "SLURM_PROCID": "11",
        "SLURM_LOCALID": "3",
        "SLURM_NODEID": "1",
        "SLURM_NTASKS_PER_NODE": "8",
        "LOCAL_RANK": "0",
    }  # one visible GCD per task
    topo = detect_topology(env=env)
    assert (topo.world_size, topo.ranks_per_node, topo.ranks_per_package) == (16, 8, 2)
    assert (topo.node(11), topo.local_index(11), topo.package(11)) == (1, 3, 5)
    assert [topo.package(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_torchrun_variables_elsewhere_give_one_gpu_packages():
    env = {"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"}
    topo = detect_topology(env=env)
    assert (topo.ranks_per_node, topo.ranks_per_package, topo.num_nodes) == (4, 1, 2)


def test_config_section_wins_over_the_environment():
    env = {"WORLD_SIZE": "8", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"}
    topo = detect_topology(TopologyConfig(ranks_per_node=4, ranks_per_package=2), env=env)
    assert (topo.ranks_per_node, topo.ranks_per_package) == (4, 2)


def test_non_block_rank_order_is_rejected():
    env = {
        "SLURM_NTASKS": "16",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "1",
        "SLURM_NTASKS_PER_NODE": "8",
    }  # cyclic distribution: rank 1 on node 1
    with pytest.raises(ConfigError, match="block distribution"):
        detect_topology(env=env)


def test_partial_nodes_are_rejected_with_every_factor():
    with pytest.raises(
        ConfigError, match=r"world\(12\) is not a whole number of nodes of topology.ranks_per_node\(8\)"
    ):
        Topology(12, 8, 2)


def test_link_classes():
    topo = Topology(16, 8, 2)
    assert topo.link_class(0, 1) == "package"
    assert topo.link_class(0, 2) == "node"
    assert topo.link_class(7, 8) == "inter_node"


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_levels_of_megatron_dp_groups_at_64_ranks(tp):
    """Megatron's order puts TP innermost: DP group members are strided by TP."""
    topo = Topology(64, 8, 2)
    for first in range(tp):
        dp_group = list(range(first, 64, tp))
        for rank in dp_group:
            m = level_members(topo, dp_group, rank)
            assert all(topo.package(r) == topo.package(rank) for r in m["package"])
            assert all(topo.node(r) == topo.node(rank) for r in m["node"])
            assert m["global"] == dp_group
            assert len(m["package"]) == max(1, 2 // tp)
            assert len(m["node"]) == 8 // tp
            assert len(m["cross_node"]) == 8  # one member per node
            assert len({topo.node(r) for r in m["cross_node"]}) == 8
            # a hop's groups multiply back to the parent: package x cross_package = node
            assert len(m["package"]) * len(m["cross_package"]) == len(m["node"])
        for kind in ("package", "node", "cross_package", "cross_node"):
            groups = partition_of(topo, dp_group, kind)
            assert sorted(r for g in groups for r in g) == dp_group


def test_fake_process_group_builds_all_level_groups_at_64():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=64)
    try:
        topo = Topology(64, 8, 2)
        dp_group = list(range(1, 64, 2))  # TP=2
        mine = all_level_groups(topo, [list(range(first, 64, 2)) for first in range(2)])
        assert mine.members["node"] == [1, 3, 5, 7]
        assert mine.members["cross_node"] == list(range(5, 64, 8))
        assert dist.get_world_size(mine.groups["node"]) == 4
        assert dist.get_world_size(mine.groups["cross_node"]) == 8
        assert set(mine.members["global"]) == set(dp_group)
    finally:
        dist.destroy_process_group()


def _level_sums() -> dict:
    import torch

    topo = Topology(8, 4, 2)  # 2 nodes x 2 packages x 2
    rank = dist.get_rank()
    out = {}
    mine = all_level_groups(
        topo, [list(range(first, 8, 2)) for first in range(2)]
    )  # TP=2: DP {0,2,4,6}, {1,3,5,7}
    for kind, group in mine.groups.items():
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        out[kind] = t.item()
    return out


def test_level_groups_reduce_over_the_right_ranks_on_gloo(run_ranks):
    results = run_ranks(8, _level_sums)
    assert results[0] == {
        "package": 0.0,
        "node": 2.0,
        "global": 12.0,
        "cross_package": 2.0,
        "cross_node": 4.0,
    }
    assert results[5] == {
        "package": 5.0,
        "node": 12.0,
        "global": 16.0,
        "cross_package": 12.0,
        "cross_node": 6.0,
    }


def test_each_member_set_is_one_group_at_tp4_on_frontier_nodes(monkeypatch):
    """64 ranks, 8 per node, 2 per package, TP=4: each DP group has one member per package, so its
    package groups are single ranks and cross_package has the node group's members. Every member set
    is made once (27 per DP group: 16 single ranks, 8 nodes, 2 cross-node, the whole group), the
    kinds sharing a set share the object, the group of each rank alone is reused for the
    model-parallel group, and teardown destroys each group once."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from deepspeed_ext.zero.config import HierarchicalZeroConfig
    from deepspeed_ext.zero.engine.levels import build_levels

    topo, tp, rank = Topology(64, 8, 2), 4, 5
    parents = [list(range(first, 64, tp)) for first in range(tp)]
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=64)
    try:
        made, destroyed = [], []
        new_group, destroy = dist.new_group, dist.destroy_process_group

        def counting_new_group(ranks, *args, **kwargs):
            made.append(tuple(ranks))
            return new_group(ranks, *args, **kwargs)

        def counting_destroy(group=None):
            destroyed.append(group)
            return destroy(group)

        def known_parents(out, obj, group=None):  # the fake group moves no data
            out[:] = [next(p for p in parents if r in p) for r in range(64)]

        monkeypatch.setattr(dist, "new_group", counting_new_group)
        monkeypatch.setattr(dist, "destroy_process_group", counting_destroy)
        monkeypatch.setattr(dist, "all_gather_object", known_parents)
        mine = all_level_groups(topo, parents)
        assert len(made) == len(set(made)) == tp * 27
        assert mine.members["package"] == [5] and mine.members["cross_package"] == [1, 5]
        assert mine.groups["cross_package"] is mine.groups["node"]
        assert len({id(g) for g in mine.groups.values()}) == 4

        dp_group = dist.new_group(parents[1])
        made.clear()
        levels = build_levels(topo, dp_group, "node", HierarchicalZeroConfig())
        assert len(made) == len(set(made)) == tp * 27  # no second group of each rank alone
        assert levels.self_group is levels.groups.groups["package"]
        assert levels.secondary_group is levels.groups.groups["cross_package"]
        assert dist.get_process_group_ranks(levels.self_group) == [rank]
        assert levels.dp_plan().sizes == (1, 2, 8)
        groups = set(map(id, levels.groups.groups.values()))
        levels.destroy_groups()
        assert len(destroyed) == len({id(g) for g in destroyed}) == 4
        assert {id(g) for g in destroyed} == groups
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()


def test_a_secondary_level_spanning_the_data_parallel_group_is_refused():
    """Its group would be the data-parallel group object itself; the planner never asks for it."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from deepspeed_ext.zero.config import HierarchicalZeroConfig
    from deepspeed_ext.zero.engine.levels import build_levels

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        with pytest.raises(ValueError, match="node spans the whole data-parallel group"):
            build_levels(Topology(8, 8, 2), None, "node", HierarchicalZeroConfig())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_cross_node_groups_are_rank_aligned_one_per_local_position(tp):
    """PCCL's rank-aligned sub-communicators: 4 nodes of 8 ranks, DP groups strided by TP. Each
    cross-node group holds one local position, one rank per node, and a node's DP members are
    spread over as many groups as it has members, so every one of them sends across nodes at once."""
    topo = Topology(world_size=32, ranks_per_node=8, ranks_per_package=2)
    for first in range(tp):
        dp = list(range(first, 32, tp))
        groups = partition_of(topo, dp, GroupKind.CROSS_NODE)
        check_rank_aligned(topo, groups)
        assert len(groups) == 8 // tp
        for group in groups:
            assert [r // 8 for r in group] == [0, 1, 2, 3]
            assert len({r % 8 for r in group}) == 1


def test_a_cross_node_group_off_its_position_is_refused_naming_it():
    topo = Topology(world_size=16, ranks_per_node=8, ranks_per_package=2)
    with pytest.raises(ConfigError, match=r"cross-node group \[0, 9\] holds local positions \[0, 1\]"):
        check_rank_aligned(topo, [[0, 9]])
    with pytest.raises(ConfigError, match="one rank per node"):
        check_rank_aligned(topo, [[0, 8, 16 - 8]])
