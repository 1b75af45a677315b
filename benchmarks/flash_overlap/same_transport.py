"""The baselines' collectives carried by the project's P2P exchange, so that a comparison measures the
overlap schedule and not the transport (on the emulated cluster gloo's collectives move the same bytes
about 1.5x slower than the P2P exchange).

Context managers, used by the benchmark only, each restoring what it swapped on exit.

Method in full: benchmarks/results/methods.md, `benchmarks.flash_overlap.same_transport`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
import torch.distributed as dist

from mdsp_base import dispatch
from megatron_ext.layers.p2p.all_to_all import start_all_to_all
from megatron_ext.layers.p2p.link import OverlapGroup
from megatron_ext.layers.p2p.overlap import start_all_gather, start_reduce_scatter


class _Posted:
    """What ``async_op=True`` returns: megatron-core only calls ``wait()`` on it."""

    def __init__(self, wait: Callable[[], object]) -> None:
        self._wait = wait

    def wait(self) -> bool:
        self._wait()
        return True


def _og(group: dist.ProcessGroup | None, name: str) -> OverlapGroup:
    return OverlapGroup(dist.group.WORLD if group is None else group, "direct", name=name)


def p2p_all_gather_into_tensor(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> _Posted | None:
    """``torch.distributed.all_gather_into_tensor`` (sequence dim 0) as a P2P exchange."""
    wait = start_all_gather(input, _og(group, "megatron-core all-gather on P2P"), output)
    if async_op:
        return _Posted(wait)
    wait()
    return None


def p2p_reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> _Posted | None:
    """``torch.distributed.reduce_scatter_tensor`` (sum over dim 0 slices) as a P2P exchange."""
    if op != dist.ReduceOp.SUM:
        raise ValueError(f"the P2P reduce-scatter sums; {op} is not supported")
    finish = start_reduce_scatter(input, _og(group, "megatron-core reduce-scatter on P2P"))

    def wait() -> None:
        output.copy_(finish())

    if async_op:
        return _Posted(wait)
    wait()
    return None


@contextmanager
def _megatron_core_collectives(
    all_gather: Callable[..., Any], reduce_scatter: Callable[..., Any]
) -> Iterator[None]:
    """megatron-core's sequence-parallel linears with their all-gather and reduce-scatter swapped
    (module docstring lists the bindings); restored on exit, also on error."""
    from megatron.core.tensor_parallel import layers, mappings

    swaps = [
        (module, name, fn)
        for module in (layers, mappings)
        for name, fn in (("dist_all_gather_func", all_gather), ("dist_reduce_scatter_func", reduce_scatter))
    ]
    originals = [(module, name, getattr(module, name)) for module, name, _ in swaps]
    try:
        for module, name, fn in swaps:
            setattr(module, name, fn)
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


def megatron_core_on_p2p() -> AbstractContextManager[None]:
    """megatron-core's sequence-parallel linears with their collectives on the P2P exchange."""
    return _megatron_core_collectives(p2p_all_gather_into_tensor, p2p_reduce_scatter_tensor)


def _nothing_moved(
    output: torch.Tensor, input: torch.Tensor, *_: Any, async_op: bool = False, **__: Any
) -> _Posted | None:
    """A collective that moves nothing: ``output`` keeps what its allocation held."""
    return _Posted(lambda: None) if async_op else None


def megatron_core_without_communication() -> AbstractContextManager[None]:
    """megatron-core's sequence-parallel linears with every all-gather and reduce-scatter of theirs a
    no-op: each rank runs exactly its own kernels (norms and residuals on its 1/N of the sequence,
    GEMMs at the gathered shapes) and nothing moves. The compute-only twin: its values are not the
    layer's."""
    return _megatron_core_collectives(_nothing_moved, _nothing_moved)


@contextmanager
def torch_on_p2p() -> Iterator[None]:
    """torch.distributed's all-gather and reduce-scatter into/of one tensor on the P2P exchange, for
    every caller in this process; restored on exit."""
    swaps = {
        "all_gather_into_tensor": p2p_all_gather_into_tensor,
        "_all_gather_base": p2p_all_gather_into_tensor,
        "reduce_scatter_tensor": p2p_reduce_scatter_tensor,
        "_reduce_scatter_base": p2p_reduce_scatter_tensor,
    }
    originals = {name: getattr(dist, name) for name in swaps}
    try:
        for name, fn in swaps.items():
            setattr(dist, name, fn)
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def p2p_all_to_all_single(
    output: torch.Tensor,
    tensor: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    **_: Any,
) -> _Posted | None:
    """``all_to_all_single`` with even splits of dim 0 (what ``DistributedAttention`` uses with head
    counts the group divides) as n-1 P2P steps posted at once; ``async_op=True`` (its ``sp_stream``
    overlap) returns a handle whose ``wait()`` completes it."""
    if output_split_sizes or input_split_sizes:
        raise ValueError("the P2P all-to-all takes even splits (DistributedAttention's path for even heads)")
    wait = start_all_to_all(output, tensor, _og(group, "DistributedAttention all-to-all on P2P"))
    if async_op:
        return _Posted(wait)
    wait()
    return None


@contextmanager
def deepspeed_on_p2p() -> Iterator[None]:
    """DeepSpeed's ``DistributedAttention`` with its all-to-alls on the P2P exchange; restored on exit."""
    import deepspeed.comm as ds_comm

    original = ds_comm.all_to_all_single
    ds_comm.all_to_all_single = p2p_all_to_all_single
    try:
        yield
    finally:
        ds_comm.all_to_all_single = original


@contextmanager
def deepspeed_all_reduce_on_p2p() -> Iterator[None]:
    """``deepspeed.comm.all_reduce`` (in-place sum, what DeepSpeed's Domino layers call) as the P2P
    reduce-scatter then all-gather of its rows. Every all-reduce runs on one worker thread in issue
    order, as NCCL runs a communicator's collectives on one stream, so that the caller's next kernels
    are issued while it moves; ``async_op=True`` returns a handle whose ``wait()`` joins it. Restored,
    and the worker stopped, on exit."""
    import deepspeed.comm as ds_comm

    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="all-reduce on P2P")

    def all_reduce(
        tensor: torch.Tensor,
        op: Any = dist.ReduceOp.SUM,
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
        **_: Any,
    ) -> _Posted | None:
        og = _og(group, "Domino all-reduce on P2P")
        if op != dist.ReduceOp.SUM or tensor.shape[0] % og.size:
            raise ValueError(
                f"the P2P all-reduce sums rows split evenly: op {op}, {tensor.shape[0]} rows over {og.size} ranks"
            )
        modes = dispatch.modes_for_thread()

        def run() -> None:
            with torch.no_grad(), ExitStack() as stack:
                dispatch.entered(modes, stack)
                start_all_gather(start_reduce_scatter(tensor, og)(), og, tensor)()

        posted = _Posted(worker.submit(run).result)
        if async_op:
            return posted
        posted.wait()
        return None

    original = ds_comm.all_reduce
    ds_comm.all_reduce = all_reduce
    try:
        yield
    finally:
        ds_comm.all_reduce = original
        worker.shutdown(wait=True)
