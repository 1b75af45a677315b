"""Topology of an emulated cluster: dataclasses, named profiles and validation."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from deepspeed_ext.zero.cost.collectives import FRONTIER_RCCL, Algorithm
from mdsp_base.topology import LinkClass

# Shaping through veth + tbf stays accurate up to about this rate on a small host; above it the
# kernel's packet processing, not the shaper, becomes the limit and measurements stop meaning much.
MAX_RATE_MBIT = 500.0
# Every rank runs a full Python + torch process; beyond this a small host only measures its own CPU.
MAX_WORLD_SIZE = 64
# Addresses are 10.77.<node>.<host>: the node octet must stay a valid host part inside 10.77.0.0/16.
MAX_NODES = 250
SUBNET = "10.77"
# One-way delays beyond this only measure timeouts; gloo's and TCP's defaults assume LAN round trips.
MAX_LATENCY_MS = 100.0
# Emulated time per Frontier time for latencies (the cost model's ring step latencies on Frontier,
# 2 / 4 / 10 us: package / node / inter-node): 10 us across nodes become 10 ms, about half of one ring
# step of a 1 MB gather over 16 ranks on a 50 Mbit/s NIC shared by 2 ranks (62.5 KB at 25 Mbit/s:
# 20 ms), so latency matters at CPU speed. The rates are Frontier's / 4000 (25 GB/s -> 50 Mbit/s),
# so the emulator's latency x bandwidth product is a quarter of Frontier's.
FRONTIER_LATENCY_SCALE = 1000.0


@dataclass(frozen=True)
class RankPlace:
    """Where one rank sits in the topology."""

    rank: int
    """Global rank, 0 .. world_size - 1."""
    node: int
    """Node index, 0 .. nodes - 1."""
    package: int
    """Package (e.g. one MI250X) index inside the node, 0 .. packages_per_node - 1."""
    local_in_package: int
    """Index of the rank inside its package, 0 .. ranks_per_package - 1."""
    local_rank: int
    """Index of the rank inside its node, as LOCAL_RANK gives it."""


@dataclass(frozen=True)
class ClusterSpec:
    """A cluster of nodes x packages per node x ranks per package with one rate per link class."""

    nodes: int
    """Number of nodes."""
    packages_per_node: int
    """Packages (devices sharing a fast fabric, e.g. the two GCDs of one MI250X) per node."""
    ranks_per_package: int
    """Ranks per package."""
    package_mbit: float
    """Rate in Mbit/s between two ranks of the same package."""
    node_mbit: float
    """Rate in Mbit/s between ranks of different packages of the same node."""
    inter_node_mbit: float
    """Rate in Mbit/s between ranks of different nodes."""
    name: str = "custom"
    """Label shown in reports."""
    shared_nic: bool = True
    """One inter-node link per package, shared by its ranks in each direction (Frontier: one NIC per
    MI250X); False gives every rank its own inter-node link."""
    package_latency_ms: float = 0.0
    """One-way delay in ms added to every packet between two ranks of the same package."""
    node_latency_ms: float = 0.0
    """One-way delay in ms between ranks of different packages of the same node."""
    inter_node_latency_ms: float = 0.0
    """One-way delay in ms between ranks of different nodes."""

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError(f"invalid cluster spec '{self.name}': " + "; ".join(problems))

    def problems(self) -> list[str]:
        """Every reason this spec cannot be built, each naming the offending factor."""
        out: list[str] = []
        for field in ("nodes", "packages_per_node", "ranks_per_package"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                out.append(f"{field}={value!r} must be an integer >= 1")
        rates = self._rate_problems()
        if out:
            return out + rates  # the size checks below need valid integers
        if self.nodes > MAX_NODES:
            out.append(f"nodes={self.nodes} exceeds {MAX_NODES} (one address octet per node)")
        if self.world_size > MAX_WORLD_SIZE:
            out.append(
                f"nodes={self.nodes} x packages_per_node={self.packages_per_node} x "
                f"ranks_per_package={self.ranks_per_package} = {self.world_size} ranks exceeds {MAX_WORLD_SIZE}"
            )
        if (self.packages_per_node + 1) * self._package_block > 256:
            out.append(
                f"packages_per_node={self.packages_per_node} x ranks_per_package={self.ranks_per_package} "
                f"do not fit one address octet: (packages_per_node + 1) x "
                f"{self._package_block} (ranks_per_package rounded up to a power of two) must be <= 256"
            )
        return out + rates

    def _rate_problems(self) -> list[str]:
        out = []
        for field in ("package_mbit", "node_mbit", "inter_node_mbit"):
            value = getattr(self, field)
            if (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or not 0 < value <= MAX_RATE_MBIT
            ):
                out.append(f"{field}={value!r} must be a rate in Mbit/s in (0, {MAX_RATE_MBIT:g}]")
        for field in ("package_latency_ms", "node_latency_ms", "inter_node_latency_ms"):
            value = getattr(self, field)
            if (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or not 0 <= value <= MAX_LATENCY_MS
            ):
                out.append(f"{field}={value!r} must be a delay in ms in [0, {MAX_LATENCY_MS:g}]")
        return out

    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return self.nodes * self.packages_per_node * self.ranks_per_package

    @property
    def ranks_per_node(self) -> int:
        """Ranks on one node (LOCAL_WORLD_SIZE)."""
        return self.packages_per_node * self.ranks_per_package

    @property
    def _package_block(self) -> int:
        # Each package owns an aligned power-of-two block of host numbers so that one u32 prefix
        # match selects exactly the ranks of that package.
        return 1 << math.ceil(math.log2(self.ranks_per_package)) if self.ranks_per_package > 1 else 1

    @property
    def package_prefix_len(self) -> int:
        """Prefix length of the address block of one package."""
        return 32 - int(math.log2(self._package_block))

    def place(self, rank: int) -> RankPlace:
        """Node, package and local indices of a rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside 0..{self.world_size - 1}")
        node, local_rank = divmod(rank, self.ranks_per_node)
        package, local_in_package = divmod(local_rank, self.ranks_per_package)
        return RankPlace(rank, node, package, local_in_package, local_rank)

    def address(self, rank: int) -> str:
        """IPv4 address of a rank: 10.77.<node>.<(package + 1) * block + index in package>."""
        p = self.place(rank)
        # Blocks start at package + 1 so no rank gets host number 0.
        return f"{SUBNET}.{p.node}.{(p.package + 1) * self._package_block + p.local_in_package}"

    def package_net(self, rank: int) -> str:
        """CIDR of the address block of the rank's package."""
        p = self.place(rank)
        return f"{SUBNET}.{p.node}.{(p.package + 1) * self._package_block}/{self.package_prefix_len}"

    def node_net(self, rank: int) -> str:
        """CIDR of the addresses of the rank's node."""
        return f"{SUBNET}.{self.place(rank).node}.0/24"

    def link_class(self, a: int, b: int) -> LinkClass:
        """Link class that traffic between ranks a and b crosses."""
        pa, pb = self.place(a), self.place(b)
        if pa.node != pb.node:
            return LinkClass.INTER_NODE
        return LinkClass.PACKAGE if pa.package == pb.package else LinkClass.NODE

    def rate_mbit(self, link: LinkClass) -> float:
        """Configured rate of a link class."""
        return {
            LinkClass.PACKAGE: self.package_mbit,
            LinkClass.NODE: self.node_mbit,
            LinkClass.INTER_NODE: self.inter_node_mbit,
        }[link]

    def latency_ms(self, link: LinkClass) -> float:
        """Configured one-way delay of a link class."""
        return {
            LinkClass.PACKAGE: self.package_latency_ms,
            LinkClass.NODE: self.node_latency_ms,
            LinkClass.INTER_NODE: self.inter_node_latency_ms,
        }[link]

    def delayed_classes(self) -> list[LinkClass]:
        """Link classes of this layout that carry a delay."""
        return [link for link in self.link_classes() if self.latency_ms(link) > 0]

    def nic(self, rank: int) -> int:
        """Index of the NIC a rank's inter-node traffic goes through (its package's, or its own)."""
        p = self.place(rank)
        return p.node * self.packages_per_node + p.package if self.shared_nic else rank

    @property
    def ranks_per_nic(self) -> int:
        """Ranks sharing one inter-node link."""
        return self.ranks_per_package if self.shared_nic else 1

    def link_classes(self) -> list[LinkClass]:
        """Link classes that actually occur in this layout."""
        present = []
        if self.ranks_per_package > 1:
            present.append(LinkClass.PACKAGE)
        if self.packages_per_node > 1:
            present.append(LinkClass.NODE)
        if self.nodes > 1:
            present.append(LinkClass.INTER_NODE)
        return present

    def sample_pair(self, link: LinkClass) -> tuple[int, int]:
        """A pair of ranks (0 and a peer) whose traffic crosses the given link class."""
        for peer in range(1, self.world_size):
            if self.link_class(0, peer) == link:
                return 0, peer
        raise ValueError(f"layout '{self.name}' has no {link} link")

    def to_dict(self) -> dict[str, object]:
        """Plain dict for JSON reports."""
        return asdict(self)


def frontier(nodes: int = 2, packages_per_node: int = 2, shared_nic: bool = True) -> ClusterSpec:
    """Frontier ratios (GCD-GCD 200 GB/s : MI250X-MI250X 100 GB/s : NIC 25 GB/s) scaled to 400:200:50
    Mbit/s, one NIC per package (MI250X) shared by its two ranks."""
    return ClusterSpec(
        nodes, packages_per_node, 2, 400.0, 200.0, 50.0, name="frontier", shared_nic=shared_nic
    )


def frontier_latency(
    nodes: int = 8,
    packages_per_node: int = 1,
    scale: float = FRONTIER_LATENCY_SCALE,
    shared_nic: bool = True,
) -> ClusterSpec:
    """The frontier profile's rates plus one-way delays per link class in Frontier's latency ratio
    (the cost model's ring step latencies) times ``scale``: 2 / 4 / 10 ms at the default scale of 1000. The default
    layout is 8 nodes of one MI250X each (2 ranks sharing one NIC): 16 ranks."""
    base = frontier(nodes, packages_per_node, shared_nic)
    ms = {str(link): FRONTIER_RCCL.fits[(link, Algorithm.RING)].step_us * scale / 1000 for link in LinkClass}
    return replace(
        base,
        name="frontier_latency",
        package_latency_ms=ms["package"],
        node_latency_ms=ms["node"],
        inter_node_latency_ms=ms["inter_node"],
    )


def frontier_bandwidth(nodes: int = 4, packages_per_node: int = 1, shared_nic: bool = True) -> ClusterSpec:
    """The frontier profile's rates with no delay added: each algorithm step then costs what the
    host's processes and kernel take (a few ms with 8 ranks on 2 cores, measured by the probe), so
    a message of ~1 MB is some hundred times the inter-node latency x bandwidth product, as a 20B
    step's ~100 MB are on Frontier (``python -m benchmarks.studies.zero.regime``). Default layout: 4 nodes
    of one MI250X each (2 ranks sharing one NIC)."""
    return replace(frontier(nodes, packages_per_node, shared_nic), name="frontier_bandwidth")


def generic(
    nodes: int = 2, ranks_per_node: int = 2, node_mbit: float = 400.0, inter_node_mbit: float = 100.0
) -> ClusterSpec:
    """Two-level cluster: one rank per package, node-local links vs inter-node links."""
    # package_mbit is never used with one rank per package; it only has to be valid.
    return ClusterSpec(nodes, ranks_per_node, 1, node_mbit, node_mbit, inter_node_mbit, name="generic")


PROFILES = {
    "frontier": frontier,
    "frontier_latency": frontier_latency,
    "frontier_bandwidth": frontier_bandwidth,
    "generic": generic,
}


def profile(name: str) -> ClusterSpec:
    """Named profile with its default layout."""
    if name not in PROFILES:
        raise ValueError(f"unknown profile '{name}', choose one of {sorted(PROFILES)}")
    return PROFILES[name]()


FRONTIER_NIC_MBIT = 200_000.0
"""One Slingshot-11 NIC, 25 GB/s (OLCF's Frontier user guide): the emulated NIC is it / dilation."""


def dilation_of(spec: ClusterSpec) -> float:
    """The time dilation that makes the emulated NIC Frontier's: device time is stretched as much."""
    return FRONTIER_NIC_MBIT / spec.inter_node_mbit
