"""Hierarchical all-gather and reduce-scatter that hand every rank what the flat collective would.

A flat collective over ``p`` members becomes a chain of hops whose sizes multiply to ``p`` (a
member's index is the mixed-radix number of its hop indices); each hop crosses a slower link with
less data. A hop across nodes runs the library's ring or the point-to-point algorithm of
:mod:`.p2p_hops`; with ``pieces > 1`` pieces pipeline across the levels. The arithmetic:
docs/hierarchical_zero_modules.md."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from deepspeed_ext.zero.config import InterNodeAlgorithm
from deepspeed_ext.zero.cost.collectives import Algorithm, Operation
from deepspeed_ext.zero.engine import p2p_hops, quantize
from deepspeed_ext.zero.engine.hop_worker import Stage
from deepspeed_ext.zero.engine.levels import HopSchedule
from mdsp_base import comm, spans
from mdsp_base.topology import LinkClass


def _digits_outer_first(plan: HopSchedule) -> list[int]:
    return list(reversed(plan.sizes))


def _reversed_axes(plan: HopSchedule) -> list[int]:
    """Permutation that turns a [digit..., block] view's digit order around (its own inverse)."""
    return [*reversed(range(len(plan.sizes))), len(plan.sizes)]


def _inner_major(blocks: torch.Tensor, plan: HopSchedule) -> torch.Tensor:
    """[p, block] in parent order -> [p, block] with the innermost hop index varying slowest."""
    view = blocks.view(*_digits_outer_first(plan), -1)
    return view.permute(_reversed_axes(plan)).reshape(blocks.shape)


def hop_order(plan: HopSchedule, flat: torch.Tensor) -> torch.Tensor:
    """A reduce-scatter's input ([p * block], parent order) in the order its hops split it."""
    p = math.prod(plan.sizes)
    if flat.numel() % p:
        raise ValueError(f"buffer of {flat.numel()} elements does not split into {p} equal blocks")
    return _inner_major(flat.view(p, -1), plan).reshape(-1)


def algorithm(plan: HopSchedule, i: int, operation: Operation, nbytes: int) -> Algorithm:
    """How hop ``i`` moves a buffer of ``nbytes`` (gathered output / reduce-scatter input)."""
    if plan.links[i] != LinkClass.INTER_NODE or plan.inter_node == InterNodeAlgorithm.RING:
        return Algorithm.RING
    if plan.inter_node == InterNodeAlgorithm.RECURSIVE:
        return Algorithm.RECURSIVE
    if plan.profile is None:  # no measurement on this cluster: the library's collective
        return Algorithm.RING
    # measured with the node's rank-aligned groups crossing at once, as this hop's do
    return plan.profile.fastest(LinkClass.INTER_NODE, operation, plan.sizes[i], nbytes)


def gather_hop(
    plan: HopSchedule, i: int, held: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Hop ``i`` of an all-gather: every member's ``held`` in the hop group's rank order, in ``out``
    (a fresh buffer when None)."""
    if out is None:
        out = torch.empty(held.numel() * plan.sizes[i], dtype=held.dtype, device=held.device)
    nbytes = out.numel() * out.element_size()
    if algorithm(plan, i, Operation.ALL_GATHER, nbytes) == Algorithm.RECURSIVE:
        p2p_hops.all_gather(out, held, plan.groups[i])
    else:
        comm.all_gather_into_tensor(out, held, group=plan.groups[i])
    return out


def reduce_hop(plan: HopSchedule, i: int, held: torch.Tensor) -> torch.Tensor:
    """Hop ``i`` of a reduce-scatter, in place: this member's slice of ``held``, summed over the
    hop group (as DeepSpeed's flat call leaves it, so the hops allocate nothing)."""
    nbytes = held.numel() * held.element_size()
    if algorithm(plan, i, Operation.REDUCE_SCATTER, nbytes) == Algorithm.RECURSIVE:
        return p2p_hops.reduce_scatter(held, plan.groups[i])
    out = held.view(plan.sizes[i], -1)[dist.get_rank(plan.groups[i])]
    comm.reduce_scatter_tensor(out, held, group=plan.groups[i])
    return out


def reduce_scatter_hops(plan: HopSchedule, held: torch.Tensor, hops: range) -> torch.Tensor:
    """Run reduce-scatter hops ``hops`` (indices into the plan, innermost first) on ``held``, in
    place; the result is a view into ``held``."""
    for i in hops:
        if plan.sizes[i] > 1:
            held = reduce_hop(plan, i, held)
    return held


def reduce_scatter(plan: HopSchedule, flat: torch.Tensor) -> torch.Tensor:
    """Sum of ``flat`` over the parent group, this member's ``1/p`` block (like reduce_scatter_tensor)."""
    return reduce_scatter_hops(plan, hop_order(plan, flat), range(len(plan.sizes)))


def _gathered_view(plan: HopSchedule, out: torch.Tensor) -> torch.Tensor:
    """``out`` ([p * n], parent order) seen as [s_0, .., s_m, n]: the layout the gather hops leave."""
    return out.view(*_digits_outer_first(plan), -1).permute(_reversed_axes(plan))


def _moving_hops(plan: HopSchedule, block: torch.Tensor, out: torch.Tensor) -> list[int]:
    """The hops of a gather that move data, outermost first, once ``out`` is checked to hold every
    member's ``block``."""
    p = math.prod(plan.sizes)
    if out.numel() != p * block.numel():
        raise ValueError(f"output of {out.numel()} elements is not {p} blocks of {block.numel()}")
    return [i for i in reversed(range(len(plan.sizes))) if plan.sizes[i] > 1]


def all_gather(
    plan: HopSchedule, block: torch.Tensor, out: torch.Tensor, int8_block: int | None = None
) -> None:
    """Fill ``out`` ([p * block] elements) with every member's ``block`` in parent order; with
    ``int8_block``, hops across nodes send blockwise int8 with that many elements per scale.

    ``block`` may be a view into ``out`` (DeepSpeed's partitions are): the first hop reads it into
    its own buffer before anything writes ``out``, so it needs no copy."""
    moving, held = _moving_hops(plan, block, out), block.reshape(-1)
    if len(moving) == 1 and (int8_block is None or plan.links[moving[0]] != LinkClass.INTER_NODE):
        # one hop: its group's rank order is the parent's, so it gathers straight into ``out``
        gather_hop(plan, moving[0], held, out.view(-1))
        return
    for i in moving:
        if int8_block is not None and plan.links[i] == LinkClass.INTER_NODE:
            gathered = torch.empty(held.numel() * plan.sizes[i], dtype=held.dtype, device=held.device)
            quantize.all_gather_int8(gathered, held, plan.groups[i], int8_block)
        else:
            gathered = gather_hop(plan, i, held)
        held = gathered
    # copied through a view of ``out`` in the hops' layout (no third full-size buffer)
    with spans.span("reorder gathered", "copy", bytes=out.numel() * out.element_size()):
        _gathered_view(plan, out).copy_(held.view(*plan.sizes, -1))


def all_gather_stages(plan: HopSchedule, block: torch.Tensor, out: torch.Tensor, pieces: int) -> list[Stage]:
    """:func:`all_gather` (unquantized) cut along the block into ``pieces`` chains of hops,
    outermost first, each piece copied into ``out`` by its last hop (a piece's first hop reads its
    columns of ``block`` before its last writes them, so ``block`` may be a view into ``out``)."""
    hops, source, n = _moving_hops(plan, block, out), block.reshape(-1), block.numel()
    target, width = _gathered_view(plan, out), max(1, math.ceil(n / pieces))
    if not hops:
        return [Stage(plan.groups[0], functools.partial(out.view(-1).copy_, source))]
    if len(hops) == 1 and width >= n:  # one hop, one piece: straight into ``out``
        return [
            Stage(plan.groups[hops[0]], functools.partial(gather_hop, plan, hops[0], source, out.view(-1)))
        ]
    stages: list[Stage] = []
    for start in range(0, n, width):
        piece = slice(start, min(n, start + width))
        state = [source[piece]]
        for step, i in enumerate(hops):

            def run(
                i: int = i, state: list = state, piece: slice = piece, last: bool = i == hops[-1]
            ) -> torch.Tensor:
                state[0] = gather_hop(plan, i, state[0])
                if last:
                    with spans.span("reorder gathered piece", "copy"):
                        target[..., piece].copy_(state[0].view(*plan.sizes, -1))
                return state[0]

            stages.append(Stage(plan.groups[i], run, (len(stages) - 1,) if step else ()))
    return stages


def reduce_scatter_stages(plan: HopSchedule, pieces: torch.Tensor, results: list) -> list[Stage]:
    """The reduce-scatter hops of each row of ``pieces`` (:func:`pack`'s buffer), innermost first;
    piece ``k``'s block lands in ``results[k]``."""
    hops = [i for i in range(len(plan.sizes)) if plan.sizes[i] > 1]
    results[:] = list(pieces)
    stages: list[Stage] = []
    for k in range(pieces.shape[0]):
        for step, i in enumerate(hops):

            def run(i: int = i, k: int = k) -> torch.Tensor:
                results[k] = reduce_hop(plan, i, results[k])
                return results[k]

            stages.append(Stage(plan.groups[i], run, (len(stages) - 1,) if step else ()))
    return stages


def hop_rows(plan: HopSchedule, device: torch.device) -> tuple[torch.Tensor, tuple[int, ...]]:
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


def pack(
    tensors: Sequence[torch.Tensor], plan: HopSchedule, pieces: int = 1
) -> tuple[torch.Tensor, list[int]]:
    """Several tensors as one buffer averaged over the parent, in hop order, with the chunking of
    DeepSpeed's ``reduce_scatter_coalesced``: tensor ``t`` cut into ``p`` chunks of ``ceil(numel/p)``
    (zero-padded), member ``i``'s chunks side by side in its row, the rows written straight into hop
    order (:func:`hop_order`, without its copy). The row's columns are cut into ``pieces`` equal
    ranges, each range's rows contiguous: returns ([pieces, p * width] buffer, chunk length per
    tensor); with one piece, row 0 is the whole buffer. A ``copy`` span while spans record."""
    with spans.span("pack gradients", "copy", tensors=len(tensors)):
        return _pack(tensors, plan, pieces)


def _pack(tensors: Sequence[torch.Tensor], plan: HopSchedule, pieces: int) -> tuple[torch.Tensor, list[int]]:
    """The body of :func:`pack`."""
    p = math.prod(plan.sizes)
    chunks = [math.ceil(t.numel() / p) for t in tensors]
    width = max(1, math.ceil(sum(chunks) / pieces))
    # every element is written below, the padding with zeros: no pass over the whole bucket first
    rows = torch.empty(pieces, p, width, dtype=tensors[0].dtype, device=tensors[0].device)
    where, where_ints = hop_rows(plan, rows.device)

    def spans(column: int, k: int) -> Iterator[tuple[int, slice, slice]]:
        """Columns column .. column+k of a row as (piece, its columns there, the same of the k)."""
        done = 0
        while done < k:
            piece, at = divmod(column + done, width)
            take = min(k - done, width - at)
            yield piece, slice(at, at + take), slice(done, done + take)
            done += take

    def put(index: torch.Tensor | int, column: int, values: torch.Tensor) -> None:
        """``values`` ([rows, k] or [k]) into columns column .. column+k of the rows ``index``."""
        for piece, at, taken in spans(column, values.shape[-1]):
            rows[piece][index, at] = values[..., taken]

    def put_all(column: int, values: torch.Tensor) -> None:
        """Every member's ``values / p`` ([p, k], parent order) into columns column .. column+k: hop
        order is a permutation of the digits, so a strided write does it (no index, no temporary)."""
        for piece, at, taken in spans(column, values.shape[-1]):
            target = rows[piece][:, at].view(*plan.sizes, -1).permute(_reversed_axes(plan))
            torch.div(values[:, taken].view(*_digits_outer_first(plan), -1), p, out=target)

    def pad(index: torch.Tensor | int, column: int, k: int) -> None:
        """Zeros into columns column .. column+k of the rows ``index``."""
        for piece, at, _ in spans(column, k):
            rows[piece][index, at] = 0

    def average(column: int, k: int) -> None:
        """Columns column .. column+k of every row divided by ``p``, in place."""
        for piece, at, _ in spans(column, k):
            rows[piece][:, at].div_(p)

    offset = 0
    for t, c in zip(tensors, chunks):
        if c == 0:
            continue
        flat, full = t.reshape(-1), t.numel() // c
        if full == p:  # no padding: one strided write that averages as it goes
            put_all(offset, flat.view(p, c))
            offset += c
            continue
        put(where[:full], offset, flat[: full * c].view(full, c))
        if full * c < t.numel():  # the last, partial chunk, zero-padded; later rows all padding
            put(where_ints[full], offset, flat[full * c :])
            pad(where_ints[full], offset + t.numel() - full * c, (full + 1) * c - t.numel())
            full += 1
        pad(where[full:], offset, c)
        average(offset, c)  # in place: a division on the way in would need a temporary of the rows
        offset += c
    pad(where, offset, pieces * width - offset)  # the columns past the last tensor's
    return rows.view(pieces, -1), chunks


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


def reduce_scatter_coalesced(plan: HopSchedule, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Average-reduce-scatter of several tensors at once, with the contract of DeepSpeed's
    ``reduce_scatter_coalesced`` (see :func:`pack`)."""
    blocks, chunks = pack(tensors, plan)
    mine = reduce_scatter_hops(plan, blocks[0], range(len(plan.sizes)))
    return unpack(mine, tensors, chunks, plan.parent.index(dist.get_rank()))
