"""Bytes per NIC recomputed from a recorded A/B run's calls, against hand-derived figures."""

from __future__ import annotations

from benchmarks.zero.nic_bytes import groups_of, nic_table, topology_of

MIB = 1 << 20
SPEC = {"nodes": 4, "packages_per_node": 1, "ranks_per_package": 2}  # 8 ranks, one NIC per node


def _call(collective: str, algorithm: str, link: str, members: int, nbytes: int, count: float) -> dict:
    return {
        "collective": collective,
        "algorithm": algorithm,
        "link": link,
        "members": members,
        "nbytes": nbytes,
        "count": count,
    }


def test_each_variant_s_groups_follow_from_the_topology() -> None:
    topology = topology_of(SPEC)
    assert groups_of(topology, "zero3", 8, "inter_node") == [list(range(8))]
    assert groups_of(topology, "hpZ(2)", 2, "package") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups_of(topology, "ours", 4, "inter_node") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups_of(topology, "ours", 2, "package") == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_nic_bytes_of_a_recorded_run() -> None:
    record = {
        "spec": SPEC,
        "variants": [
            # A flat ring all-gather of 8 MiB: 7 MiB on each edge, one edge out of each NIC.
            {
                "variant": "zero3",
                "bytes_per_step": {"inter_node": 7 * MIB},
                "calls_per_step": [_call("all_gather", "ring", "inter_node", 8, 8 * MIB, 1.0)],
            },
            # Twice a step a package all-gather of 2 MiB (1 MiB each way per package), nothing out of a NIC.
            {
                "variant": "hpZ(2)",
                "bytes_per_step": {"inter_node": 0},
                "calls_per_step": [_call("all_gather", "ring", "package", 2, 2 * MIB, 2.0)],
            },
            # Cross-node groups {0,2,4,6} and {1,3,5,7}: a ring all-gather of 4 MiB (3 MiB per rank)
            # and a recursive reduce-scatter of 4 MiB (1 + 2 MiB per rank); both ranks of a package
            # send through its NIC: 2 x 6 = 12 MiB, against 6 MiB per rank counted by edge class.
            {
                "variant": "ours",
                "bytes_per_step": {"inter_node": 6 * MIB},
                "calls_per_step": [
                    _call("all_gather", "ring", "inter_node", 4, 4 * MIB, 1.0),
                    _call("reduce_scatter", "recursive", "inter_node", 4, 4 * MIB, 1.0),
                ],
            },
            {"variant": "zero++ (hpZ + qwZ + qgZ)", "ran": False},
        ],
    }
    assert nic_table(record) == {
        "zero3": {
            "edge_class_inter_node_mib_per_rank": 7,
            "nic_mib_per_step": 7,
            "package_link_mib_per_step": 7,
        },
        "hpZ(2)": {
            "edge_class_inter_node_mib_per_rank": 0,
            "nic_mib_per_step": 0,
            "package_link_mib_per_step": 2,
        },
        "ours": {
            "edge_class_inter_node_mib_per_rank": 6,
            "nic_mib_per_step": 12,
            "package_link_mib_per_step": 0,
        },
    }
