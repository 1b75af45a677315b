"""One rank of the launch count: kernels per layer, forward and backward, under each method.

Counted with torch's dispatch mode on the calling thread: every ATen operator that runs a kernel
(views and allocations excluded; on a GPU each is a launch), by kind: GEMMs, attention, the rest
(copies, concatenations, elementwise), and communication (the c10d operators: one per P2P send or
receive, one per collective).

Method in full: benchmarks/results/methods.md, `benchmarks.studies.flash_overlap.launches_rank`.
"""

from __future__ import annotations

import argparse
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.flash_overlap.blocks import Block, Shapes
from benchmarks.flash_overlap.ulysses_rank import local_attention
from mdsp_base.shutdown import exit_without_teardown
from megatron_ext.layers.p2p.link import OverlapGroup
from megatron_ext.layers.ulysses import HeadSplit, ulysses_attention

_NO_KERNEL = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "lift_fresh",
    "detach",
}
_GEMM = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"}


class LaunchCounter(TorchDispatchMode):
    """Counts kernel-running ATen operators by kind while active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.overloadpacket.__name__
        if func.namespace == "c10d":
            self.counts["comm"] += 1
        elif not func.is_view and name not in _NO_KERNEL:
            kind = "gemm" if name in _GEMM else "attention" if "scaled_dot_product" in name else "other"
            self.counts[kind] += 1
        return func(*args, **(kwargs or {}))


def count(forward: Callable[[], torch.Tensor], cotangent: torch.Tensor) -> dict[str, dict[str, int]]:
    """Kernels (and the c10d operators this thread issued) of ``forward()`` and of its backward."""
    result = {}
    with LaunchCounter() as counter:
        out = forward()
    result["forward"] = dict(counter.counts)
    with LaunchCounter() as counter:
        out.backward(cotangent)
    result["backward"] = dict(counter.counts)
    return result


MERGED_GEMMS = 2
"""GEMMs per collective of ``flash_overlap_merged`` (``flash_overlap.compute_slices``): the fewest."""


def _tp_layer(method: str, shapes: Shapes, group: dist.ProcessGroup) -> dict:
    n, r = group.size(), group.rank()
    torch.manual_seed(1)
    block = Block("layer", method, shapes, group, n, compute_slices=MERGED_GEMMS)
    x = torch.randn(shapes.seq, shapes.batch, shapes.hidden).chunk(n)[r].contiguous().requires_grad_()
    (layer,) = block.module  # the "layer" block: a stack of one
    return count(lambda: layer(x, attention_mask=block.mask)[0], torch.ones_like(x))


def ulysses_launches(method: str, seq: int, hidden: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    """One forward and backward of a Ulysses attention ``method`` on this rank's group, with the
    kernel launches it made counted."""
    n = dist.get_world_size()
    split = HeadSplit(heads, kv_heads, head_dim, n, group_major=method == "ulysses_group_major")
    w_qkv = torch.randn((heads + 2 * kv_heads) * head_dim, hidden, requires_grad=True)
    w_out = torch.randn(hidden, heads * head_dim, requires_grad=True)
    x = torch.randn(seq // n, 1, hidden, requires_grad=True)
    if method == "distributed_attention":
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention

        deepspeed.comm.init_distributed(dist_backend="gloo", verbose=False)
        stock = DistributedAttention(
            lambda q, k, v: local_attention(q, k, v).view(q.shape), dist.group.WORLD, 2, 0
        )

        def forward() -> torch.Tensor:
            q, k, v = torch.split(
                F.linear(x, w_qkv), [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1
            )
            q, k, v = (t.reshape(*t.shape[:2], -1, head_dim) for t in (q, k, v))
            return F.linear(stock(q, k, v, 1, None).flatten(2), w_out)
    else:
        og = OverlapGroup(dist.group.WORLD, "direct", name="ulysses_attention")

        def forward() -> torch.Tensor:
            return ulysses_attention(x, w_qkv, None, w_out, local_attention, split, og)

    return count(forward, torch.ones(seq // n, 1, hidden))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=16)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method="env://")
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_ext.integration.core_on_cpu import enable_cpu_support

    enable_cpu_support()
    n = dist.get_world_size()
    ps.initialize_model_parallel(tensor_model_parallel_size=n, create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(0)
    hidden = args.heads * args.head_dim
    shapes = Shapes(args.seq, 1, hidden, args.heads, 4 * hidden)
    result: dict[str, Any] = {"world_size": n, "args": vars(args), "tp_layer": {}, "ulysses": {}}
    # merging needs a rank's peers to be more than one slice
    for method in (
        "megatron_core",
        "flash_overlap",
        *(("flash_overlap_merged",) if n > MERGED_GEMMS else ()),
    ):
        result["tp_layer"][method] = _tp_layer(method, shapes, ps.get_tensor_model_parallel_group())
    for method in ("distributed_attention", "ulysses_qkv_layout", "ulysses_group_major"):
        result["ulysses"][method] = ulysses_launches(
            method, args.seq, hidden, args.heads, args.kv_heads, args.head_dim
        )
    dist.barrier()
    from benchmarks.cluster import write_result

    write_result(result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
