"""Bytes per NIC per step of each variant of a recorded A/B run, recomputed from the calls per step
it recorded and each algorithm's geometry (:mod:`mdsp_base.links`).

Method in full: benchmarks/results/methods.md, `benchmarks.zero.nic_bytes`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from deepspeed_ext.zero.cost.collectives import recursive_schedule
from mdsp_base.links import PhysicalLink, Transfer, link_loads, most_loaded, transfers
from mdsp_base.topology import GroupKind, Topology, partition_of
from mdsp_base.volume import span_class

MIB = 1 << 20


def topology_of(spec: Mapping) -> Topology:
    """The job's layout from a run's emulated-cluster ``spec``."""
    per_node = spec["packages_per_node"] * spec["ranks_per_package"]
    return Topology(spec["nodes"] * per_node, per_node, spec["ranks_per_package"])


def groups_of(topology: Topology, variant: str, members: int, link: str) -> list[list[int]]:
    """Every group a call of ``members`` ranks spanning ``link`` runs on in ``variant``."""
    world = list(range(topology.world_size))
    if not variant.startswith("ours"):
        return [world[i : i + members] for i in range(0, len(world), members)]
    for kind in GroupKind:
        groups = partition_of(topology, world, kind)
        if len(groups[0]) == members and span_class(topology, groups[0]) == link:
            return groups
    raise ValueError(f"{variant}: no level group of {members} ranks spans {link} in {topology}")


def step_transfers(topology: Topology, variant: str, calls: Sequence[Mapping]) -> list[Transfer]:
    """Every transfer of one step: each recorded call on each of its groups, times its count."""
    out = []
    for call in calls:
        for group in groups_of(topology, variant, call["members"], call["link"]):
            moves = transfers(
                call["collective"],
                call["algorithm"],
                call["nbytes"],
                group,
                schedule=recursive_schedule(len(group)),
            )
            out.extend(Transfer(t.src, t.dst, round(t.nbytes * call["count"])) for t in moves)
    return out


def nic_table(record: Mapping) -> dict[str, dict[str, float]]:
    """Per variant that recorded its calls: the recorded edge-class inter-node MiB per step (the most
    loaded rank's) and the recomputed MiB per step of the most loaded NIC and package link."""
    topology = topology_of(record["spec"])
    out = {}
    for row in record["variants"]:
        if not row.get("calls_per_step"):
            continue
        most = most_loaded(
            link_loads(topology, step_transfers(topology, row["variant"], row["calls_per_step"]))
        )
        out[row["variant"]] = {
            "edge_class_inter_node_mib_per_rank": row["bytes_per_step"]["inter_node"] / MIB,
            "nic_mib_per_step": most[PhysicalLink.NIC_EGRESS] / MIB,
            "package_link_mib_per_step": most[PhysicalLink.PACKAGE] / MIB,
        }
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="result JSON of python -m benchmarks.zero.ab")
    for path in parser.parse_args(argv).results:
        print(f"{path}: MiB per step")
        print(
            f"{'variant':<12} {'inter-node, edge class, per rank':>33} {'most loaded NIC':>16} {'package link':>13}"
        )
        for variant, row in nic_table(json.loads(path.read_text())).items():
            print(
                f"{variant:<12} {row['edge_class_inter_node_mib_per_rank']:>33.2f} "
                f"{row['nic_mib_per_step']:>16.2f} {row['package_link_mib_per_step']:>13.2f}"
            )


if __name__ == "__main__":
    main()
