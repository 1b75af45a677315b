"""Which network transport NCCL (or RCCL) picked, read from its init log, checked at start-up.

Without the network plugin (aws-ofi-rccl / aws-ofi-nccl) RCCL and NCCL fall back to TCP sockets on
Slingshot, silently and an order of magnitude slower; so does NCCL when InfiniBand cannot start. A
job across nodes on sockets although a high-speed interface is present stops at start-up with one
line (:class:`TransportError`), or goes on under a warning with ``ALLOW_SOCKET_TRANSPORT=1``.
:func:`capture_init_log` has NCCL write its INIT and NET messages to a file and
:func:`check_transport` reads its ``Using network ...`` line (docs/slurm.md, "The transport check
at start-up").
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mdsp_base.installer import Installer
from mdsp_base.section import ConfigError
from megatron_ext.integration.refusal import first_rank_of_node

OWNER = "megatron_ext.integration.transport"
ALLOW = "ALLOW_SOCKET_TRANSPORT"
NETWORK = re.compile(r"[NR]CCL INFO Using network (.+?)\s*$", re.M)
PLUGIN = re.compile(r"[NR]CCL INFO NET/OFI Using (aws-ofi-[nr]ccl\S*(?: \S+)?)", re.M)
SOCKETS = re.compile(r"[NR]CCL INFO NET/Socket ?: Using (.+?)\s*$", re.M)
INTERFACE = re.compile(r"\[\d+\]([^:\s]+):")
# Slingshot's interfaces (hsn0..3) and InfiniBand's (ib0...): the names the vendors' drivers give
FAST_NAMES = re.compile(r"^(hsn|ib)\d+$")


class TransportError(ConfigError):
    """A job across nodes would run its collectives over TCP sockets beside a high-speed network."""


@dataclass(frozen=True)
class Transport:
    """What one process's NCCL init log says about its network."""

    network: str
    """NCCL's name of the network it uses: ``Socket``, ``IB``, ``AWS Libfabric``..."""
    plugin: str | None
    """The libfabric plugin and its version where one loaded (``aws-ofi-rccl 1.4.0``)."""
    socket_interfaces: tuple[str, ...]
    """The interfaces the socket transport found, where it started."""


def parse_init_log(text: str) -> Transport | None:
    """The transport of an NCCL/RCCL ``NCCL_DEBUG=INFO`` log; None where it names no network yet."""
    networks = NETWORK.findall(text)
    if not networks:
        return None
    plugin = PLUGIN.search(text)
    sockets = SOCKETS.search(text)
    return Transport(
        network=networks[0],
        plugin=plugin.group(1) if plugin else None,
        socket_interfaces=tuple(INTERFACE.findall(sockets.group(1))) if sockets else (),
    )


def fast_interfaces(sys_class: Path = Path("/sys/class")) -> list[str]:
    """This node's high-speed network: Slingshot or InfiniBand interfaces, and the devices of the
    Cassini (``cxi``) and InfiniBand drivers."""
    found = [p.name for p in sorted((sys_class / "net").glob("*")) if FAST_NAMES.match(p.name)]
    for driver in ("cxi", "infiniband"):
        found += [f"{driver}:{p.name}" for p in sorted((sys_class / driver).glob("*"))]
    return found


def spans_nodes(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the job's ranks are on more than one node (Slurm's node count, or torchrun's world
    beyond its node's ranks)."""
    if int(env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", "1")) or 1) > 1:
        return True
    local = env.get("LOCAL_WORLD_SIZE")
    return local is not None and int(env.get("WORLD_SIZE", local)) > int(local)


def verdict(transport: Transport, across_nodes: bool, fast: list[str], allow: bool) -> str | None:
    """The one line for a job across nodes on sockets beside ``fast`` interfaces (an error, or a
    warning where ``allow``); None when the transport is fine."""
    if transport.network != "Socket" or not across_nodes or not fast:
        return None
    over = ", ".join(transport.socket_interfaces) or "TCP"
    line = (
        f"NCCL/RCCL runs this multi-node job over TCP sockets ({over}) although this node has "
        f"{', '.join(fast)}: no network plugin loaded (on Slingshot put aws-ofi-rccl's or aws-ofi-nccl's "
        "lib/ on LD_LIBRARY_PATH, AWS_OFI_RCCL_DIR in the Frontier script; on InfiniBand check NCCL_IB_HCA); "
    )
    if allow:
        return "WARNING: " + line + f"going on because {ALLOW}=1: expect collectives ~10x slower"
    return line + f"{ALLOW}=1 runs it anyway"


def capture_init_log(installer: Installer) -> bool:
    """On GPUs, have NCCL write its init log where :func:`check_transport` reads it (see the
    module's doc); whether it will be checked. Notices go to stderr from each node's first rank."""
    import torch

    if not torch.cuda.is_available():
        return False
    if "NCCL_DEBUG" in os.environ and "NCCL_DEBUG_FILE" not in os.environ:
        _print(
            "transport not checked: NCCL_DEBUG is set without NCCL_DEBUG_FILE, so its log goes to the output"
        )
        return False
    if "NCCL_DEBUG" not in os.environ:
        folder = tempfile.mkdtemp(prefix="nccl-init-")
        installer.add(OWNER, "the NCCL init log's folder (removed)", lambda: shutil.rmtree(folder, True))
        for name, value in (
            ("NCCL_DEBUG", "INFO"),
            ("NCCL_DEBUG_SUBSYS", "INIT,NET"),
            ("NCCL_DEBUG_FILE", os.path.join(folder, "nccl.%h.%p.log")),
        ):
            installer.setenv(
                OWNER,
                "NCCL_DEBUG, NCCL_DEBUG_SUBSYS and NCCL_DEBUG_FILE: its init log to a file",
                name,
                value,
            )
    return True


def check_transport() -> None:
    """Once the job's NCCL process group exists: a barrier, at which NCCL makes its communicator
    and logs its network, then :func:`check_log` on this process's log. Another backend writes no
    NCCL log: nothing to check."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() != "nccl":
        return
    dist.barrier(device_ids=[torch.cuda.current_device()])
    pattern = os.environ["NCCL_DEBUG_FILE"]
    host = socket.gethostname().split(".")[0]  # NCCL's %h: the host name up to its first dot
    check_log(Path(pattern.replace("%h", host).replace("%p", str(os.getpid()))))


def check_log(path: Path, sys_class: Path = Path("/sys/class")) -> None:
    """Read the NCCL init log at ``path`` (its communicator made): raise :class:`TransportError`
    or print the warning, per :func:`verdict` on this job's nodes and the interfaces under
    ``sys_class``."""
    text = path.read_text(errors="replace") if path.is_file() else ""
    transport = parse_init_log(text)
    if transport is None:
        _print(f"transport not checked: {path} names no network")
        return
    line = verdict(transport, spans_nodes(), fast_interfaces(sys_class), os.environ.get(ALLOW) == "1")
    if line is None:
        return
    if line.startswith("WARNING"):
        _print(line)
    else:
        raise TransportError(line)


def _print(line: str) -> None:
    """``line`` on stderr from each node's first rank."""
    if first_rank_of_node():
        print(line, file=sys.stderr, flush=True)
