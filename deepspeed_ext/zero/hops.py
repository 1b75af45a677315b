"""Hierarchical all-gather and reduce-scatter that hand every rank what the flat collective would.

A flat collective over a parent of ``p`` members moves ``p`` equal blocks, block ``i`` belonging to
the member with group rank ``i``. With hops of sizes ``s_0`` (innermost) .. ``s_m`` (outermost),
``i`` is the mixed-radix number ``(d_m, ..., d_0)``. Reduce-scatter: reorder the blocks so that
``d_0`` varies slowest, reduce-scatter over hop 0 (each member keeps the ``p/s_0`` blocks with its
``d_0``), then hop 1 on that result, and so on; the last hop leaves block ``i``. All-gather runs
the hops in the opposite order and undoes the reordering at the end. Each hop crosses a slower
link with less data: the outermost (inter-node) hop carries ``1/(s_0 * ... * s_{m-1})`` of it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from deepspeed_ext import comm
from deepspeed_ext.topology import LinkClass
from deepspeed_ext.zero import quantize
from deepspeed_ext.zero.levels import HopPlan


def _digits_outer_first(plan: HopPlan) -> list[int]:
    return list(reversed(plan.sizes))


def _reversed_axes(plan: HopPlan) -> list[int]:
    """Permutation that turns a [digit..., block] view's digit order around (its own inverse)."""
    return [*reversed(range(len(plan.sizes))), len(plan.sizes)]


def _inner_major(blocks: torch.Tensor, plan: HopPlan) -> torch.Tensor:
    """[p, block] in parent order -> [p, block] with the innermost hop index varying slowest."""
    view = blocks.view(*_digits_outer_first(plan), -1)
    return view.permute(_reversed_axes(plan)).reshape(blocks.shape)


def hop_order(plan: HopPlan, flat: torch.Tensor) -> torch.Tensor:
    """A reduce-scatter's input ([p * block], parent order) in the order its hops split it."""
    p = math.prod(plan.sizes)
    if flat.numel() % p:
        raise ValueError(f"buffer of {flat.numel()} elements does not split into {p} equal blocks")
    return _inner_major(flat.view(p, -1), plan).reshape(-1)


def reduce_scatter_hops(plan: HopPlan, held: torch.Tensor, hops: range) -> torch.Tensor:
    """Run reduce-scatter hops ``hops`` (indices into the plan, innermost first) on ``held``, in
    place: each hop's output is this member's slice of its input (as DeepSpeed's flat call does), so
    the hops allocate nothing and the result is a view into ``held``."""
    for i in hops:
        if plan.sizes[i] == 1:
            continue
        out = held.view(plan.sizes[i], -1)[dist.get_rank(plan.groups[i])]
        comm.reduce_scatter_tensor(out, held, group=plan.groups[i])
        held = out
    return held


def reduce_scatter(plan: HopPlan, flat: torch.Tensor) -> torch.Tensor:
    """Sum of ``flat`` over the parent group, this member's ``1/p`` block (like reduce_scatter_tensor)."""
    return reduce_scatter_hops(plan, hop_order(plan, flat), range(len(plan.sizes)))


def all_gather(plan: HopPlan, block: torch.Tensor, out: torch.Tensor, int8_block: int | None = None) -> None:
    """Fill ``out`` ([p * block] elements) with every member's ``block`` in parent order; with
    ``int8_block``, hops across nodes send blockwise int8 with that many elements per scale."""
    p = math.prod(plan.sizes)
    if out.numel() != p * block.numel():
        raise ValueError(f"output of {out.numel()} elements is not {p} blocks of {block.numel()}")
    held = block.reshape(-1).clone()  # ``block`` may be a view into ``out``, which the last copy overwrites
    for size, group, link in zip(reversed(plan.sizes), reversed(plan.groups), reversed(plan.links)):
        if size == 1:
            continue
        gathered = torch.empty(held.numel() * size, dtype=held.dtype, device=held.device)
        if int8_block is not None and link == LinkClass.INTER_NODE:
            quantize.all_gather_int8(gathered, held, group, int8_block)
        else:
            comm.all_gather_into_tensor(gathered, held, group=group)
        held = gathered
    # ``held`` is laid out innermost digit slowest: copy it through a view of ``out`` in that layout
    # (no third full-size buffer).
    out.view(*_digits_outer_first(plan), -1).permute(_reversed_axes(plan)).copy_(held.view(*plan.sizes, -1))


def hop_rows(plan: HopPlan, device: torch.device) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The row in hop order of each parent member, as an index tensor on ``device`` and as ints.

    Made once per plan and device and kept in ``plan.row_cache``: an index built on the host for
    every pack would be a blocking copy from pageable memory, the host waiting for the stream each
    bucket. On an accelerator the first use waits once for the copy, so that any stream may read
    the index afterwards."""
    cached = plan.row_cache.get(device)
    if cached is None:
        # the hop-order permutation of the members, inverted: where each member's row lands
        rows = _inner_major(torch.arange(math.prod(plan.sizes)).view(-1, 1), plan).view(-1).argsort()
        index = rows.to(device)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        cached = plan.row_cache[device] = (index, tuple(rows.tolist()))
    return cached


def pack(tensors: Sequence[torch.Tensor], plan: HopPlan) -> tuple[torch.Tensor, list[int]]:
    """Several tensors as one buffer averaged over the parent, in hop order, with the chunking of
    DeepSpeed's ``reduce_scatter_coalesced``: tensor ``t`` cut into ``p`` chunks of ``ceil(numel/p)``
    (zero-padded), member ``i``'s chunks side by side in its row, the rows written straight into hop
    order (:func:`hop_order`, without its copy). Returns (flat buffer, chunk length per tensor)."""
    p = math.prod(plan.sizes)
    chunks = [math.ceil(t.numel() / p) for t in tensors]
    rows = torch.zeros(p, sum(chunks), dtype=tensors[0].dtype, device=tensors[0].device)
    where, where_ints = hop_rows(plan, rows.device)
    offset = 0
    for t, c in zip(tensors, chunks):
        if c == 0:
            continue
        flat, full = t.reshape(-1), t.numel() // c
        rows[where[:full], offset : offset + c] = flat[: full * c].view(full, c)
        if full * c < t.numel():  # the last, partial chunk; later rows stay zero
            rows[where_ints[full], offset : offset + t.numel() - full * c] = flat[full * c :]
        offset += c
    return rows.div_(p).view(-1), chunks


def unpack(
    mine: torch.Tensor, tensors: Sequence[torch.Tensor], chunks: Sequence[int], me: int
) -> list[torch.Tensor]:
    """Member ``me``'s row of :func:`pack`'s buffer (reduced) as one chunk per tensor, the last
    chunks shorter or empty where ``numel`` is not a multiple of ``p``."""
    out, offset = [], 0
    for t, c in zip(tensors, chunks):
        length = max(0, min(c, t.numel() - me * c))
        out.append(mine.narrow(0, offset, length))
        offset += c
    return out


def reduce_scatter_coalesced(plan: HopPlan, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Average-reduce-scatter of several tensors at once, with the contract of DeepSpeed's
    ``reduce_scatter_coalesced`` (see :func:`pack`)."""
    blocks, chunks = pack(tensors, plan)
    mine = reduce_scatter_hops(plan, blocks, range(len(plan.sizes)))
    return unpack(mine, tensors, chunks, plan.parent.index(dist.get_rank()))
