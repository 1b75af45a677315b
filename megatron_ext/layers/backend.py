"""Which backend the Flash-Overlap linears use, decided on evidence when the layers are built.

``p2p`` (the default) runs everywhere and keeps what megatron-core keeps for backward; ``symm_mem``
(:mod:`megatron_ext.layers.symm_mem`) keeps the column layers' gathered input. ``auto`` takes
symm_mem only where every check passes on every rank of the TP group (NCCL, a supported platform,
one node of the job's topology, peer access, symmetric memory set up); else it keeps p2p and logs
why, once per process. ``symm_mem`` forced raises :class:`BackendUnavailableError` with that reason."""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Literal, TypeVar, cast

import torch
import torch.distributed as dist

from mdsp_base.topology import Topology
from megatron_ext.layers.config import Requested
from megatron_ext.layers.p2p.link import cuda_backend
from megatron_ext.layers.symm_mem import torch_fused_ops

logger = logging.getLogger(__name__)

Backend = Literal["p2p", "symm_mem"]
T = TypeVar("T")
# torch's own test suite runs its symmetric-memory ops on these ROCm architectures only.
ROCM_ARCHS = ("gfx942", "gfx950")


class BackendUnavailableError(RuntimeError):
    """flash_overlap.backend=symm_mem was forced where torch's fused ops cannot run."""


def platform_problem(device: torch.device) -> str | None:
    """Why torch's fused ops cannot run on ``device`` in this process, or None."""
    try:
        torch_fused_ops()
    except Exception as e:  # however loading them fails, they are not there to use
        return f"torch {torch.__version__} offers no symm_mem fused ops ({type(e).__name__}: {e})"
    if device.type != "cuda":
        return f"the layers run on {device.type}, not CUDA"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if torch.version.hip:
        arch = torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
        if arch not in ROCM_ARCHS:
            return f"ROCm device {arch} is not one of torch's symmetric-memory platforms {ROCM_ARCHS}"
    return None


def node_problem(ranks: Sequence[int], topology: Topology | None) -> str | None:
    """Why the group of global ``ranks`` cannot share symmetric memory by where its ranks sit, or
    None: peer-mapped memory exists only between the GPUs of one node."""
    if topology is None:
        return (
            "no topology was given, so whether the tensor-parallel group sits in one node is unknown: "
            "pass topology=mdsp_base.topology.detect_topology(...) to the layers or the layer spec"
        )
    nodes = sorted({topology.node(rank) for rank in ranks})
    if len(nodes) > 1:
        return (
            f"the tensor-parallel group {sorted(ranks)} spans nodes {nodes} ({topology.ranks_per_node} "
            "ranks per node); symmetric memory needs all its ranks in one node"
        )
    return None


def peer_problem(device: torch.device, peer_indices: Sequence[int]) -> str | None:
    """Which of the peers' GPUs (their CUDA indices) ``device`` cannot reach peer to peer, or None.
    Checked for the peers this process sees under another index; with one visible GPU per process
    the rendezvous that maps the peers' memory is the check."""
    own = torch.cuda.current_device() if device.index is None else device.index
    visible = torch.cuda.device_count()
    unreachable = sorted(
        {
            i
            for i in peer_indices
            if i is not None and i != own and i < visible and not torch.cuda.can_device_access_peer(own, i)
        }
    )
    if unreachable:
        return f"cuda:{own} has no peer-to-peer access to {', '.join(f'cuda:{i}' for i in unreachable)}"
    return None


def _enable(group: dist.ProcessGroup) -> None:
    """Enable symmetric memory for ``group`` and rendezvous a small buffer (what the ops do on their
    first call), on every rank of the group together."""
    from torch.distributed import _symmetric_memory as symm_mem

    with warnings.catch_warnings():
        # Deprecated as unneeded in recent torch, required by older ones: call it either way.
        warnings.simplefilter("ignore", FutureWarning)
        symm_mem.enable_symm_mem_for_group(group.group_name)
    symm_mem.get_symm_mem_workspace(group.group_name, min_size=1024)


def _attempt(step: Callable[[], str | None], what: str) -> str | None:
    """The step's problem; any exception it raises is one too (logged as the reason to fall back),
    so that every rank still takes part in the agreement that follows."""
    try:
        return step()
    except Exception as e:
        return f"{what} failed ({type(e).__name__}: {e})"


def _gather(group: dist.ProcessGroup, value: T) -> list[T]:
    """Every rank's ``value``, in group rank order."""
    values: list[T | None] = [None] * group.size()
    dist.all_gather_object(values, value, group=group)
    return cast(list[T], values)  # every slot filled by its rank


def _joined(problems: Sequence[str | None]) -> str | None:
    """The ranks' problems as one reason naming each rank, or None when no rank has one."""
    found = [f"rank {rank}: {p}" for rank, p in enumerate(problems) if p is not None]
    return "; ".join(found) or None


def _probe(group: dist.ProcessGroup, device: torch.device) -> str | None:
    """Platform, peer access, then set-up, each agreed by all ranks of the group (three small
    collectives) so that all pick the same backend and none enters the rendezvous alone."""
    reports = _gather(
        group, (_attempt(lambda: platform_problem(device), "checking the platform"), device.index)
    )
    problem = _joined([p for p, _ in reports])
    if problem is None:
        peers = [index for _, index in reports]
        problem = _joined(
            _gather(group, _attempt(lambda: peer_problem(device, peers), "checking peer access"))
        )
    if problem is None:
        problem = _joined(_gather(group, _attempt(lambda: _enable(group), "setting up symmetric memory")))
    return problem


# Probed once per live group, device and topology (weak keys: a destroyed group's entry goes with
# it, and a later group reusing its name is probed afresh).
_group_problems: weakref.WeakKeyDictionary[
    dist.ProcessGroup, dict[tuple[str, Topology | None], str | None]
] = weakref.WeakKeyDictionary()


def group_problem(group: dist.ProcessGroup, device: torch.device, topology: Topology | None) -> str | None:
    """Why the fused ops cannot run over ``group`` from ``device``, agreed by all its ranks, or None.
    The backend and the group's nodes are the same on every rank and decided without talking; on an
    NCCL group within one node every rank of the group must call this (:func:`_probe`), once per
    group, device and topology."""
    backend = cuda_backend(group)
    if backend != "nccl":
        return f"the tensor-parallel group's backend is {backend}, not NCCL"
    problem = node_problem(dist.get_process_group_ranks(group), topology)
    if problem is not None:
        return problem
    known = _group_problems.setdefault(group, {})
    key = (str(device), topology)
    if key not in known:
        known[key] = _probe(group, device)
    return known[key]


_logged: set[str] = set()


def _log_once(line: str) -> None:
    if line not in _logged:
        _logged.add(line)
        logger.info(line)


def resolve_backend(
    requested: str, group: dist.ProcessGroup | None, device: torch.device, topology: Topology | None = None
) -> Backend:
    """The backend the layers use. ``p2p`` is taken as is. ``auto`` gives symm_mem where torch's
    fused ops run over ``group`` from ``device`` (:func:`group_problem`: NCCL, a supported GPU, the
    group within one node of ``topology``, peer access, symmetric memory set up), else p2p with the
    reason logged, whatever failed. ``symm_mem`` raises :class:`BackendUnavailableError` naming the
    reason where they cannot run. Without TP peers (``group`` None or of size 1) there is nothing
    to fuse and both run plain GEMMs: p2p. The choice and its reason are logged once per process."""
    if requested not in tuple(Requested):
        raise ValueError(f"flash_overlap.backend='{requested}' is unknown: use one of {', '.join(Requested)}")
    choice: Backend = "p2p"
    if requested == "p2p":
        reason = "set by flash_overlap.backend"
    elif group is None or group.size() == 1:
        reason = "tensor-parallel size 1: no communication to fuse"
    else:
        try:
            problem = group_problem(group, device, topology)
        except Exception as e:  # a collective of the probe itself failed
            problem = f"probing the group failed ({type(e).__name__}: {e})"
        if problem is None:
            n = group.size()
            choice, reason = (
                "symm_mem",
                f"torch's fused ops run over the {n}-rank NCCL group on {device}, in one node; the column "
                f"layers keep their gathered input for backward, {n}x what p2p keeps for qkv and fc1",
            )
        elif requested == "symm_mem":
            raise BackendUnavailableError(
                f"flash_overlap.backend=symm_mem cannot run here: {problem}; set flash_overlap.backend=p2p "
                "(--flash-overlap-backend p2p), or auto to fall back to it where torch's fused ops cannot run"
            )
        else:
            reason = problem
    _log_once(f"Flash-Overlap backend: {choice} (flash_overlap.backend={requested}: {reason})")
    return choice
