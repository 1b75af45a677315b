"""The ``symm_mem`` backend of the Flash-Overlap linears: torch's symmetric-memory fused
all-gather + GEMM and GEMM + reduce-scatter, and the choice between it and our P2P schedule.

torch ships ``torch.ops.symm_mem.fused_all_gather_matmul`` and ``fused_matmul_reduce_scatter``:
each splits its GEMM per rank and copies the slices between GPUs through symmetric memory (CUDA
peer access) while the next slice's GEMM runs. They are forward-only ops, so the autograd
functions here pair them: the backward of the gather is a GEMM + reduce-scatter and the other way
round. :func:`resolve_backend` picks them where torch supports them (CUDA, or ROCm gfx942/gfx950;
an NCCL group whose ranks can share symmetric memory), else our P2P schedule, and logs the choice
once per process.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from megatron_ext.layers.wgrad import GemmPrecision, weight_gradient

logger = logging.getLogger(__name__)

Backend = Literal["p2p", "symm_mem"]
Requested = Literal["auto", "p2p", "symm_mem"]
REQUESTS: tuple[Requested, ...] = ("auto", "p2p", "symm_mem")
# torch's own test suite runs its symmetric-memory ops on these ROCm architectures only.
ROCM_ARCHS = ("gfx942", "gfx950")


class BackendUnavailableError(RuntimeError):
    """flash_overlap.backend=symm_mem was forced where torch's fused ops cannot run."""


AllGatherMatmul = Callable[..., tuple[torch.Tensor | None, list[torch.Tensor]]]
"""(A_shard, [B, ...], gather_dim, group_name, *, return_A) -> (gathered A or None, [A @ B, ...])."""
MatmulReduceScatter = Callable[[torch.Tensor, torch.Tensor, str, int, str], torch.Tensor]
"""(A, B, reduce_op, scatter_dim, group_name) -> this rank's part of reduce_scatter(A @ B)."""


@dataclass(frozen=True)
class FusedOps:
    """The two fused collective GEMMs the symm_mem layers call; tests substitute their own."""

    all_gather_matmul: AllGatherMatmul
    matmul_reduce_scatter: MatmulReduceScatter


def torch_fused_ops() -> FusedOps:
    """torch's symmetric-memory ops (importing the module registers ``torch.ops.symm_mem``)."""
    import torch.distributed._symmetric_memory

    return FusedOps(
        torch.ops.symm_mem.fused_all_gather_matmul, torch.ops.symm_mem.fused_matmul_reduce_scatter
    )


@dataclass(frozen=True)
class FusedGroup:
    """Where the fused ops run: the TP group's name, its size, the ops, the layer name for errors."""

    group_name: str
    size: int
    ops: FusedOps
    name: str = "flash_overlap"


class SymmMemAllGatherLinear(torch.autograd.Function):
    """Fwd: fused sequence all-gather + Y = X W^T, keeping the gathered X; bwd: dgrad GEMM fused with
    the sequence reduce-scatter, then wgrad over the kept X. GEMMs: fwd n x [s/n*b, h] x [h, o/n];
    bwd dgrad n x [s/n*b, o/n] x [o/n, h], wgrad [o/n, s*b] x [s*b, h]."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, fg: FusedGroup, fuse_wgrad: bool
    ) -> torch.Tensor:
        precision = GemmPrecision.of(x)
        keep = weight.requires_grad  # frozen weights need no wgrad, hence no gathered input
        with precision.exact():
            gathered, (out,) = fg.ops.all_gather_matmul(
                precision.cast(x).contiguous(), [precision.cast(weight).t()], 0, fg.group_name, return_A=keep
            )
        # The gathered input costs n times the shard's memory until backward; the P2P path keeps the
        # shard and gathers again under the dgrad GEMM, which torch's forward-only ops cannot do.
        ctx.save_for_backward(gathered if keep else None, weight)
        ctx.fg, ctx.precision, ctx.fuse_wgrad = fg, precision, fuse_wgrad
        return out

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        gathered, weight = ctx.saved_tensors
        fg, precision = ctx.fg, ctx.precision
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g = precision.cast(grad_out).contiguous()
        with precision.exact():
            grad_x = (
                fg.ops.matmul_reduce_scatter(g, precision.cast(weight), "sum", 0, fg.group_name)
                if want_x
                else None
            )
            grad_w = weight_gradient(g, gathered, weight, ctx.fuse_wgrad) if want_w else None
        return grad_x, grad_w, None, None


class SymmMemLinearReduceScatter(torch.autograd.Function):
    """Fwd: Y = X W^T fused with the sequence reduce-scatter; bwd: output-gradient all-gather fused
    with the dgrad GEMM, then one wgrad GEMM over the gathered gradient. GEMMs: fwd
    n x [s/n*b, i/n] x [i/n, o]; bwd dgrad n x [s/n*b, o] x [o, i/n], wgrad [o, s*b] x [s*b, i/n]."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, fg: FusedGroup, fuse_wgrad: bool
    ) -> torch.Tensor:
        precision = GemmPrecision.of(x)
        xc = precision.cast(x).contiguous()
        with precision.exact():
            out = fg.ops.matmul_reduce_scatter(xc, precision.cast(weight).t(), "sum", 0, fg.group_name)
        ctx.save_for_backward(xc if weight.requires_grad else None, weight)
        ctx.fg, ctx.precision, ctx.fuse_wgrad = fg, precision, fuse_wgrad
        return out

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        x, weight = ctx.saved_tensors
        fg, precision = ctx.fg, ctx.precision
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (want_x or want_w):
            return None, None, None, None
        g = precision.cast(grad_out).contiguous()
        with precision.exact():
            # One fused op gathers the gradient for both: its dgrad is dropped when only wgrad is wanted.
            gathered, (grad_x,) = fg.ops.all_gather_matmul(
                g, [precision.cast(weight)], 0, fg.group_name, return_A=want_w
            )
            grad_w = weight_gradient(gathered, x, weight, ctx.fuse_wgrad) if want_w else None
        return (grad_x if want_x else None), grad_w, None, None


def _cuda_backend(group: dist.ProcessGroup) -> str:
    """The group's backend for CUDA tensors ("nccl", "gloo", ...; "cpu:gloo,cuda:nccl" gives "nccl")."""
    name = str(dist.get_backend(group))
    per_device = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
    return per_device.get("cuda", name)


def platform_problem(device: torch.device) -> str | None:
    """Why torch's fused ops cannot run on ``device`` in this process, or None."""
    try:
        torch_fused_ops()
    except (ImportError, AttributeError, RuntimeError) as e:
        return f"torch {torch.__version__} offers no symm_mem fused ops ({e})"
    if device.type != "cuda":
        return f"the layers run on {device.type}, not CUDA"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if torch.version.hip:
        arch = torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
        if arch not in ROCM_ARCHS:
            return f"ROCm device {arch} is not one of torch's symmetric-memory platforms {ROCM_ARCHS}"
    return None


def _enable(group: dist.ProcessGroup) -> str | None:
    """Enable symmetric memory for ``group`` and rendezvous a small buffer (what the ops do on their
    first call), on every rank of the group together; the problem, or None."""
    from torch.distributed import _symmetric_memory as symm_mem

    try:
        with warnings.catch_warnings():
            # Deprecated as unneeded in recent torch, required by older ones: call it either way.
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group.group_name)
        symm_mem.get_symm_mem_workspace(group.group_name, min_size=1024)
    except RuntimeError as e:
        return f"symmetric memory could not be set up for the group ({e})"
    return None


def _agree(group: dist.ProcessGroup, problem: str | None) -> str | None:
    """Every rank's problem gathered, so that all ranks of the group pick the same backend."""
    problems: list[str | None] = [None] * group.size()
    dist.all_gather_object(problems, problem, group=group)
    found = [f"rank {rank}: {p}" for rank, p in enumerate(problems) if p is not None]
    return "; ".join(found) or None


# Probed once per live group and device (weak keys: a destroyed group's entry goes with it, and a
# later group reusing its name is probed afresh).
_group_problems: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[str, str | None]] = (
    weakref.WeakKeyDictionary()
)


def group_problem(group: dist.ProcessGroup, device: torch.device) -> str | None:
    """Why the fused ops cannot run over ``group`` from ``device``, agreed by all its ranks, or None.
    On an NCCL group this runs two small collectives (all ranks of the group must call it), once per
    group and device."""
    backend = _cuda_backend(group)
    if backend != "nccl":  # the same on every rank: decided without talking
        return f"the tensor-parallel group's backend is {backend}, not NCCL"
    known = _group_problems.setdefault(group, {})
    if str(device) not in known:
        problem = _agree(group, platform_problem(device))
        if problem is None:
            problem = _agree(group, _enable(group))
        known[str(device)] = problem
    return known[str(device)]


_logged: set[str] = set()


def _log_once(line: str) -> None:
    if line not in _logged:
        _logged.add(line)
        logger.info(line)


def resolve_backend(requested: str, group: dist.ProcessGroup | None, device: torch.device) -> Backend:
    """The backend the layers use: ``auto`` gives symm_mem where torch's fused ops run over ``group``
    from ``device`` (see :func:`group_problem`), else p2p; ``p2p`` is taken as is; ``symm_mem``
    raises :class:`BackendUnavailableError` naming the reason where they cannot run. Without TP peers
    (``group`` None or of size 1) there is nothing to fuse and both run plain GEMMs: p2p. The choice
    and its reason are logged once per process."""
    if requested not in REQUESTS:
        raise ValueError(f"flash_overlap.backend={requested!r} is unknown: use one of {', '.join(REQUESTS)}")
    choice: Backend = "p2p"
    if requested == "p2p":
        reason = "set by flash_overlap.backend"
    elif group is None or group.size() == 1:
        reason = "tensor-parallel size 1: no communication to fuse"
    else:
        problem = group_problem(group, device)
        if problem is None:
            choice, reason = (
                "symm_mem",
                f"torch's fused ops run over the {group.size()}-rank NCCL group on {device}",
            )
        elif requested == "symm_mem":
            raise BackendUnavailableError(
                f"flash_overlap.backend=symm_mem cannot run here: {problem}; set flash_overlap.backend=p2p "
                "(--flash-overlap-backend p2p), or auto to fall back to it where torch's fused ops are unsupported"
            )
        else:
            reason = problem
    _log_once(f"Flash-Overlap backend: {choice} (flash_overlap.backend={requested}: {reason})")
    return choice
