"""One rank of the UP (Ulysses) benchmark: self-attention with its QKV and output projections, forward +
backward, under each method, interleaved step by step with a compute-only twin and the transfers alone.

Method in full: benchmarks/results/methods.md, `benchmarks.flash_overlap.ulysses_rank`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.device import add_device_flags, stand_in
from benchmarks.flash_overlap.rank import _timed, device_per_step
from benchmarks.flash_overlap.same_transport import deepspeed_on_p2p, p2p_all_to_all_single
from mdsp_base.shutdown import exit_without_teardown
from megatron_ext.layers.p2p.link import OverlapGroup
from megatron_ext.layers.ulysses import HeadSplit, ulysses_attention

METHODS = (
    "distributed_attention_gloo",
    "distributed_attention_p2p",
    "distributed_attention_sp_stream_p2p",
    "ulysses_flash_overlap",
    "ulysses_group_major",
)


@dataclass(frozen=True)
class Sizes:
    """Sizes of the timed attention block."""

    seq_per_rank: int
    """Tokens per rank (s/n)."""
    batch: int
    """Micro-batch size b."""
    hidden: int
    """Hidden size h: the projections' input/output width."""
    heads: int
    """Attention heads (a multiple of the sequence-parallel size)."""
    kv_heads: int
    """Key/value heads (a multiple of the sequence-parallel size dividing ``heads``)."""
    head_dim: int
    """Channels per head."""


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of [s, b, heads, d] queries over [s, b, kv_heads, d] keys/values (each
    repeated for its heads/kv_heads query heads) over the whole sequence; [s, b, heads * d] out."""
    k, v = (t.repeat_interleave(q.shape[2] // k.shape[2], dim=2) for t in (k, v))
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True)
    return out.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)


class _HostStream:
    """A stream as ``DistributedAttention``'s ``sp_stream`` path uses one, on the host: work is issued
    in order on the calling thread, so waiting for another stream has nothing to wait for."""

    def wait_stream(self, _other: object) -> None:
        return None


@contextlib.contextmanager
def host_streams() -> Iterator[None]:
    """DeepSpeed's CPU accelerator has no streams (``current_stream()`` is None): hand out
    :class:`_HostStream` for the step; restored on exit."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    original = accelerator.current_stream
    accelerator.current_stream = lambda *_: _HostStream()
    try:
        yield
    finally:
        accelerator.current_stream = original


class UlyssesBlock(torch.nn.Module):
    """One method's attention block on the WORLD group; ``step()`` runs forward + backward."""

    def __init__(self, method: str, sizes: Sizes, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        """``dtype``: of weights and activations (bf16 on a stand-in device, as GPUs train)."""
        super().__init__()
        n, r = dist.get_world_size(), dist.get_rank()
        g = torch.Generator().manual_seed(seed)
        c = sizes.heads * sizes.head_dim
        s = sizes.seq_per_rank * n
        kv = sizes.kv_heads * sizes.head_dim
        self.w_qkv = torch.nn.Parameter(
            (torch.randn(c + 2 * kv, sizes.hidden, generator=g) / sizes.hidden**0.5).to(dtype)
        )
        self.w_out = torch.nn.Parameter((torch.randn(sizes.hidden, c, generator=g) / c**0.5).to(dtype))
        x = torch.randn(s, sizes.batch, sizes.hidden, generator=g).to(dtype)
        cotangent = torch.randn(s, sizes.batch, sizes.hidden, generator=g).to(dtype)
        rows = slice(r * sizes.seq_per_rank, (r + 1) * sizes.seq_per_rank)
        self.x, self.cotangent = x[rows].contiguous(), cotangent[rows].contiguous()
        self.method, self.sizes = method, sizes
        self.split = HeadSplit(sizes.heads, sizes.kv_heads, sizes.head_dim, n)
        if method == "ulysses_group_major":  # the same weights, regrouped once (as the module does)
            self.split = dataclasses.replace(self.split, group_major=True)
            with torch.no_grad():
                self.w_qkv.copy_(self.w_qkv.index_select(0, self.split.group_major_order()))
        self.og = OverlapGroup(dist.group.WORLD, "direct", name="ulysses_attention")
        if method.startswith("distributed_attention"):
            import deepspeed
            from deepspeed.sequence.layer import DistributedAttention

            deepspeed.comm.init_distributed(dist_backend="gloo", verbose=False)

            def per_head(q, k, v):  # DeepSpeed 0.19 takes the context back as [s, b, heads, d]
                return local_attention(q, k, v).view(q.shape)

            sp_stream = _HostStream() if "sp_stream" in method else None
            self.attention = DistributedAttention(per_head, dist.group.WORLD, 2, 0, sp_stream=sp_stream)
            if sp_stream is not None:
                self.attention.default_stream = _HostStream()

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.method.startswith("ulysses"):
            return ulysses_attention(x, self.w_qkv, None, self.w_out, local_attention, self.split, self.og)
        mixed = F.linear(x, self.w_qkv)
        if self.method == "compute_only":
            n = self.split.ranks
            full = mixed.view(mixed.shape[0] * n, mixed.shape[1], -1)  # the all-to-all's output shape
            context = local_attention(*self.split.split(full))
            return F.linear(context.view(x.shape[0], x.shape[1], -1), self.w_out)
        q, k, v = (
            part.reshape(*x.shape[:2], -1, self.sizes.head_dim)
            for part in mixed.split(
                [self.sizes.heads * self.sizes.head_dim, *2 * [self.sizes.kv_heads * self.sizes.head_dim]],
                dim=-1,
            )
        )
        return F.linear(self.attention(q, k, v, 1, None).flatten(2), self.w_out)

    def step(self) -> torch.Tensor:
        x = self.x.detach().requires_grad_()
        on_p2p = self.method.startswith("distributed_attention") and self.method.endswith("_p2p")
        with (
            deepspeed_on_p2p() if on_p2p else contextlib.nullcontext(),
            host_streams() if "sp_stream" in self.method else contextlib.nullcontext(),
        ):
            out = self._forward(x)
            out.backward(self.cotangent)
        return out


def comm_only(transport: str, sizes: Sizes, dtype: torch.dtype = torch.float32) -> None:
    """The step's four all-to-alls alone (QKV and context, forward and backward), on ``transport``."""
    c, t = sizes.heads * sizes.head_dim, sizes.seq_per_rank * sizes.batch
    qkv = c + 2 * sizes.kv_heads * sizes.head_dim
    for width in (qkv, c, c, qkv):
        src = torch.empty(t * width, dtype=dtype)
        move = p2p_all_to_all_single if transport == "p2p" else dist.all_to_all_single
        move(torch.empty_like(src), src)


def agreement(blocks: dict[str, UlyssesBlock]) -> dict[str, float]:
    """One warm-up step of each method; largest difference of output and gradients from DeepSpeed's."""
    results = {}
    for name, block in blocks.items():
        out = block.step()
        w_qkv = block.w_qkv.grad
        if block.split.group_major:  # compared in the [q | k | v] layout
            w_qkv = w_qkv.index_select(0, block.split.group_major_order().argsort())
        results[name] = [out.detach(), w_qkv, block.w_out.grad]
        block.zero_grad(set_to_none=True)
    reference = results["distributed_attention_gloo"]
    return {m: max((a - b).abs().max().item() for a, b in zip(r, reference)) for m, r in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-per-rank", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    add_device_flags(parser)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    hidden = args.heads * args.head_dim
    sizes = Sizes(args.seq_per_rank, args.batch, hidden, args.heads, args.kv_heads, args.head_dim)
    device = stand_in(args)
    dtype = torch.float32 if device is None else torch.bfloat16
    blocks = {m: UlyssesBlock(m, sizes, dtype=dtype) for m in (*METHODS, "compute_only")}
    load = [os.getloadavg()[0]]
    # a stand-in computes no values: there is nothing to compare
    check = agreement({m: blocks[m] for m in METHODS}) if device is None else {}
    steps = {name: block.step for name, block in blocks.items()}
    for transport in ("p2p", "collectives"):
        steps[f"comm_only_{transport}"] = lambda t=transport: comm_only(t, sizes, dtype)
    charged: dict[str, list[tuple[int, float]]] = {}
    times = _timed(steps, args.warmup, args.steps, device, charged)
    load.append(os.getloadavg()[0])
    regime = {
        "sizes": asdict(sizes),
        "times": times,
        "device_per_step": device_per_step(charged),
        "max_abs_diff_vs_distributed_attention": check,
        "load": load,
    }
    result = {
        "world_size": dist.get_world_size(),
        "args": vars(args),
        "regimes": {"real_shape": regime},
        "device": None if device is None else device.describe(),
    }
    dist.barrier()
    from benchmarks.cluster import write_result

    write_result(result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
