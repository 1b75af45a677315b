"""What the bounds are made of: the block's transfers alone (T_comm, on P2P and on the process
group's collectives) and each linear's three GEMMs timed alone.

Every column/row pair of linears moves, forward and backward, the same five sequence-parallel
transfers of a [s/N, b, h] shard: the column's all-gather of x, the row's reduce-scatter of its
output, the row's all-gather of dY, the column's re-gather of x and its reduce-scatter of dgrad.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from benchmarks.flash_overlap.blocks import Shapes

TRANSFERS_PER_PAIR = ("all_gather", "reduce_scatter", "all_gather", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class Linear:
    """One linear of the block, by kind and this rank's weight shape."""

    name: str
    """qkv, proj, fc1 or fc2."""
    column: bool
    """Column-parallel (gathers its input) or row-parallel (scatters its output)."""
    in_features: int
    """Input features on this rank."""
    out_features: int
    """Output features on this rank."""


def linears(block: str, shapes: Shapes, tp: int) -> list[Linear]:
    """The block's linears with this rank's shard shapes (one layer's, for a stack of layers)."""
    h, f = shapes.hidden, shapes.ffn // tp
    mlp = [Linear("fc1", True, h, f), Linear("fc2", False, f, h)]
    if block == "mlp":
        return mlp
    return [Linear("qkv", True, h, 3 * h // tp), Linear("proj", False, h // tp, h), *mlp]


def p2p_exchange(kind: str, shard: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Direct-pattern P2P all-gather (into ``full``) or reduce-scatter (of ``full``), each step waited."""
    n, r = group.size(), group.rank()
    slices = full.chunk(n)
    for step in range(1, n):
        src, dst = (r - step) % n, (r + step) % n
        into = slices[src] if kind == "all_gather" else torch.empty_like(shard)
        out = shard if kind == "all_gather" else slices[dst].contiguous()
        peers = (dist.get_global_rank(group, src), dist.get_global_rank(group, dst))
        works = [dist.irecv(into, peers[0], tag=step), dist.isend(out, peers[1], tag=step)]
        for work in works:
            work.wait()
        if kind == "reduce_scatter":
            shard += into


def _collective(kind: str, shard: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup) -> None:
    if kind == "all_gather":
        dist.all_gather_into_tensor(full, shard, group=group)
    else:
        dist.reduce_scatter_tensor(shard, full, group=group)


TRANSPORTS: dict[str, Callable[[str, torch.Tensor, torch.Tensor, dist.ProcessGroup], None]] = {
    "p2p": p2p_exchange,
    "collectives": _collective,
}


def comm_only(transport: str, pairs: int, shard: torch.Tensor, group: dist.ProcessGroup) -> None:
    """The block's forward + backward transfers alone, one after the other, on ``transport``."""
    full = shard.new_empty((shard.shape[0] * group.size(), *shard.shape[1:]))
    move = TRANSPORTS[transport]
    for _ in range(pairs):
        for kind in TRANSFERS_PER_PAIR:
            move(kind, shard.clone(), full, group)


def _min_time(fn: Callable[[], object], device: AbstractContextManager | None, reps: int = 5) -> float:
    """Minimum over reps: load on a shared host only ever adds time. ``device``: a stand-in device
    entered around each rep (it waits for its device on exit)."""
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        with device if device is not None else nullcontext():
            fn()
        best = min(best, time.perf_counter() - start)
    return best


def gemm_times(
    linear: Linear,
    tokens: int,
    dtype: torch.dtype = torch.float32,
    device: AbstractContextManager | None = None,
) -> dict[str, float]:
    """Forward, dgrad and wgrad GEMM of ``linear`` over the whole sequence (``tokens`` = s b), alone
    (on ``device``, a stand-in, when given)."""
    x = torch.randn(tokens, linear.in_features, dtype=dtype)
    w = torch.randn(linear.out_features, linear.in_features, dtype=dtype)
    dy = torch.randn(tokens, linear.out_features, dtype=dtype)
    return {
        "fwd": _min_time(lambda: x @ w.t(), device),
        "dgrad": _min_time(lambda: dy @ w, device),
        "wgrad": _min_time(lambda: dy.t() @ x, device),
    }
