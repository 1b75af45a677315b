"""Build and tear down the namespaces, veth pairs, bridge and tc shaping of an emulated cluster.

Method in full: benchmarks/results/methods.md, `benchmarks.cluster.netns`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

from mdsp_base.comm import LINK_CLASSES
from mdsp_base.topology import LinkClass

from . import delay
from .spec import SUBNET, ClusterSpec

DEFAULT_PREFIX = "emc"
RANK_IFACE = "eth0"
# Jumbo frames keep header overhead under 1 %, so goodput matches the configured rate (at 1500
# bytes TCP/IP/Ethernet headers eat ~4.5 % of every link). Measured: 99-100 % of the rate.
MTU = 9000
# A bare htb class holds its rate also right after idle (its default burst is one MTU-sized
# token bucket, so there is no refill burst); quantum >= a GSO packet silences size warnings.
HTB_QUANTUM = 65536
_UNITS = {"bit": 1e-6, "Kbit": 1e-3, "Mbit": 1.0, "Gbit": 1e3}
# The delay line of each cluster with latency, by prefix, until its teardown.
_DELAY_LINES: dict[str, subprocess.Popen] = {}


class ClusterUnavailable(RuntimeError):
    """The host cannot run an emulated cluster (not root, or ip/tc missing)."""


def check_prerequisites() -> None:
    """Raise ClusterUnavailable naming every missing requirement and how to fix it."""
    missing = []
    if os.geteuid() != 0:
        missing.append(
            "root privileges (network namespaces need CAP_NET_ADMIN): run as root, e.g. with sudo -E"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            missing.append(f"the '{tool}' command: install iproute2 (apt-get install -y iproute2)")
    if missing:
        raise ClusterUnavailable("emulated cluster unavailable, missing " + "; ".join(missing))


def check_prefix(prefix: str) -> None:
    """Reject prefixes that could collide with foreign names or overflow interface names."""
    # Interface names are limited to 15 characters, and teardown removes everything named <prefix>-*.
    if not (prefix.isascii() and prefix.isalnum() and prefix.islower() and 2 <= len(prefix) <= 8):
        raise ValueError(f"prefix {prefix!r} must be 2-8 lowercase letters/digits")


def sh(*cmd: str) -> str:
    """Run one ip/tc command; raise with the command and its stderr when it fails."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr.strip()}")
    return proc.stdout


def switch_ns(prefix: str) -> str:
    """Name of the namespace holding the bridge."""
    return f"{prefix}-sw"


def rank_ns(prefix: str, rank: int) -> str:
    """Name of the namespace of one rank."""
    return f"{prefix}-r{rank}"


def _port(prefix: str, rank: int) -> str:
    return f"{prefix}-p{rank}"


def list_namespaces(prefix: str) -> list[str]:
    """Namespaces whose name carries the prefix."""
    names = [line.split()[0] for line in sh("ip", "netns", "list").splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix + "-")]


def list_host_links(prefix: str) -> list[str]:
    """Links in the host namespace whose name carries the prefix (only a crashed build leaves any)."""
    links = json.loads(sh("ip", "-j", "link", "show") or "[]")
    return [link["ifname"] for link in links if link["ifname"].startswith(prefix + "-")]


def teardown(prefix: str) -> None:
    """Remove every namespace and host link with the prefix, stopping processes still inside."""
    for ns in list_namespaces(prefix):
        # A killed run can leave ranks behind; they would keep the namespace (and its links) alive.
        for pid in sh("ip", "netns", "pids", ns).split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        sh("ip", "netns", "del", ns)
    for link in list_host_links(prefix):
        sh("ip", "link", "del", link)
    line = _DELAY_LINES.pop(prefix, None)
    if line is not None:
        line.wait()  # killed with its namespace's processes above


def _class_nets(spec: ClusterSpec, rank: int) -> dict[LinkClass, str]:
    # Filters are tried in this order, so the most specific prefix must come first.
    return {"package": spec.package_net(rank), "node": spec.node_net(rank), "inter_node": f"{SUBNET}.0.0/16"}


def _shape(
    ns: str, dev: str, spec: ClusterSpec, rank: int, match: str, skip_filter: str | None = None
) -> None:
    """Give dev an htb root with one class per link class, chosen by the peer's address (`match` src
    or dst); the filter of class ``skip_filter`` is left to the caller."""
    tc = ("tc", "-n", ns)
    # Unclassified traffic (ARP, IPv6 neighbour discovery) leaves unshaped through htb's direct queue.
    sh(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb")
    nets = _class_nets(spec, rank)
    for idx, link in enumerate(LINK_CLASSES, start=1):
        if link not in spec.link_classes():
            continue
        rate = f"{round(spec.rate_mbit(link) * 1000)}kbit"
        sh(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", f"1:{idx}",
           "htb", "rate", rate, "ceil", rate, "quantum", str(HTB_QUANTUM))  # fmt: skip
        if link == skip_filter:
            continue
        sh(*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", str(idx),
           "u32", "match", "ip", match, nets[link], "flowid", f"1:{idx}")  # fmt: skip


def _nic_devices(prefix: str, nic: int) -> tuple[str, str]:
    """The ifb devices of one NIC: what it sends to other nodes, what it receives from them."""
    return f"{prefix}-t{nic}", f"{prefix}-x{nic}"


def _build_nic(sw: str, prefix: str, nic: int, spec: ClusterSpec) -> None:
    rate = f"{round(spec.inter_node_mbit * 1000)}kbit"
    for dev in _nic_devices(prefix, nic):
        sh("ip", "-n", sw, "link", "add", dev, "type", "ifb")
        sh("ip", "-n", sw, "link", "set", dev, "mtu", str(MTU), "up")
        sh("tc", "-n", sw, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1")
        sh("tc", "-n", sw, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1",
           "htb", "rate", rate, "ceil", rate, "quantum", str(HTB_QUANTUM))  # fmt: skip


def _port_ingress(sw: str, port: str, prefix: str, spec: ClusterSpec, rank: int, shared: bool) -> None:
    """Send what the rank puts on its port to the delay line's tap of its link class, else (shared
    NIC, to other nodes) to its NIC's tx device, else straight to the bridge."""
    delayed = spec.delayed_classes()
    if not delayed and not shared:
        return
    sh("tc", "-n", sw, "qdisc", "add", "dev", port, "handle", "ffff:", "ingress")
    nets = _class_nets(spec, rank)
    for idx, link in enumerate(LINK_CLASSES, start=1):
        if link not in spec.link_classes():
            continue
        if link in delayed:
            action = ["action", "mirred", "egress", "redirect", "dev", delay.tap_name(prefix, link)]
        elif link == LinkClass.INTER_NODE and shared:
            action = [
                "action",
                "mirred",
                "egress",
                "redirect",
                "dev",
                _nic_devices(prefix, spec.nic(rank))[0],
            ]
        else:
            # A match without action ends classification: the packet goes on to the bridge (no gact
            # action needed, which some kernels lack), and no later, wider prefix catches it.
            action = ["classid", "1:1"]
        sh("tc", "-n", sw, "filter", "add", "dev", port, "parent", "ffff:", "protocol", "ip", "prio", str(idx),
           "u32", "match", "ip", "dst", nets[link], *action)  # fmt: skip
    if shared:
        # To the rank from other nodes: the NIC's rx device first, then (classification skipped on
        # the way back, the flowid stays) the port's own inter-node class.
        idx = LINK_CLASSES.index("inter_node") + 1
        sh("tc", "-n", sw, "filter", "add", "dev", port, "parent", "1:", "protocol", "ip", "prio", str(idx),
           "u32", "match", "ip", "src", f"{SUBNET}.0.0/16", "flowid", f"1:{idx}",
           "action", "mirred", "egress", "redirect", "dev", _nic_devices(prefix, spec.nic(rank))[1])  # fmt: skip


def _delayed_to_nic(sw: str, prefix: str, spec: ClusterSpec) -> None:
    """Inter-node packets back from the delay line go to their sender's NIC tx device; ifb then
    returns them to the tap's ingress, classification skipped, and so to the bridge."""
    tap = delay.tap_name(prefix, LinkClass.INTER_NODE)
    sh("tc", "-n", sw, "qdisc", "add", "dev", tap, "handle", "ffff:", "ingress")
    for nic in sorted({spec.nic(r) for r in range(spec.world_size)}):
        rank = next(r for r in range(spec.world_size) if spec.nic(r) == nic)
        sh("tc", "-n", sw, "filter", "add", "dev", tap, "parent", "ffff:", "protocol", "ip", "prio", "1",
           "u32", "match", "ip", "src", spec.package_net(rank),
           "action", "mirred", "egress", "redirect", "dev", _nic_devices(prefix, nic)[0])  # fmt: skip


def _mbit(text: str) -> float:
    number = text.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    return float(number) * _UNITS[text[len(number) :]]


def _verify_shaping(ns: str, dev: str, spec: ClusterSpec) -> None:
    """Fail loudly unless dev carries one htb class per link class at its configured rate and ceil."""
    found = {}
    for line in sh("tc", "-n", ns, "class", "show", "dev", dev).splitlines():
        m = re.match(r"class htb 1:(\d+) .*\brate (\S+) ceil (\S+)", line)
        if m:
            found[int(m[1])] = (_mbit(m[2]), _mbit(m[3]))
    for idx, link in enumerate(LINK_CLASSES, start=1):
        if link not in spec.link_classes():
            continue
        want = spec.rate_mbit(link)
        got = found.get(idx)
        if got is None or any(abs(v - want) > 0.01 * want for v in got):
            raise RuntimeError(
                f"shaping on {ns}/{dev} is not as configured: {link} class {got}, expected {want} Mbit/s"
            )


def build(spec: ClusterSpec, prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Create the switch namespace, one shaped namespace per rank; return the rank namespaces."""
    check_prefix(prefix)
    if spec.delayed_classes() and (missing := delay.check_compiler()):
        raise ClusterUnavailable(f"latency emulation unavailable, missing {missing}")
    sw = switch_ns(prefix)
    bridge = f"{prefix}-br"
    sh("ip", "netns", "add", sw)
    sh("ip", "-n", sw, "link", "add", bridge, "type", "bridge")
    sh("ip", "-n", sw, "link", "set", bridge, "up")
    shared = spec.shared_nic and "inter_node" in spec.link_classes()
    if shared:
        for nic in sorted({spec.nic(r) for r in range(spec.world_size)}):
            _build_nic(sw, prefix, nic, spec)
    if spec.delayed_classes():
        _DELAY_LINES[prefix] = delay.start(spec, sw, prefix, bridge, sh)
        if shared and LinkClass.INTER_NODE in spec.delayed_classes():
            _delayed_to_nic(sw, prefix, spec)
    namespaces = []
    for rank in range(spec.world_size):
        ns, port = rank_ns(prefix, rank), _port(prefix, rank)
        sh("ip", "netns", "add", ns)
        # Created inside the switch namespace with the peer directly in the rank's: never on the host.
        sh("ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", RANK_IFACE, "netns", ns)
        sh("ip", "-n", sw, "link", "set", port, "mtu", str(MTU), "master", bridge, "up")
        sh("ip", "-n", ns, "addr", "add", f"{spec.address(rank)}/16", "dev", RANK_IFACE)
        sh("ip", "-n", ns, "link", "set", RANK_IFACE, "mtu", str(MTU), "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        if spec.delayed_classes():
            # With milliseconds of round trip, restarting slow start after every idle gap (the
            # default) would add round trips to each collective that RDMA links do not have.
            sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0")
        if spec.link_classes():
            _shape(ns, RANK_IFACE, spec, rank, "dst")
            _shape(sw, port, spec, rank, "src", skip_filter="inter_node" if shared else None)
            _port_ingress(sw, port, prefix, spec, rank, shared)
            _verify_shaping(ns, RANK_IFACE, spec)
            _verify_shaping(sw, port, spec)
        namespaces.append(ns)
    return namespaces


def sent_bytes(dev: str = RANK_IFACE) -> dict[str, int]:
    """Bytes ``dev`` of the calling process's namespace has sent, per link class (its tc classes)
    and in all (its interface counter): call it from inside a rank."""
    out = dict.fromkeys(LINK_CLASSES, 0)
    text = sh("tc", "-s", "class", "show", "dev", dev)
    for m in re.finditer(r"class htb 1:(\d+) .*?\n\s*Sent (\d+) bytes", text):
        out[LINK_CLASSES[int(m[1]) - 1]] = int(m[2])
    out["total"] = int(Path(f"/sys/class/net/{dev}/statistics/tx_bytes").read_text())
    return out
