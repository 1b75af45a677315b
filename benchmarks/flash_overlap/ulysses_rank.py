"""One rank of the UP (Ulysses) benchmark: self-attention with its QKV and output projections, forward +
backward, under each method, interleaved step by step with a compute-only twin and the transfers alone.

Methods (same projections, same local attention: causal SDPA over the whole sequence for heads/n):
  ulysses_flash_overlap      ``megatron_ext.layers.ulysses.ulysses_attention``: both all-to-alls cut
                             into P2P steps overlapped with the projections;
  distributed_attention_p2p  DeepSpeed's ``DistributedAttention`` between the projections (as
                             Megatron-DeepSpeed's Ulysses path), its all-to-alls on the P2P exchange
                             (``same_transport.deepspeed_on_p2p``): the same transport as ours;
  distributed_attention_gloo the same on gloo's all_to_all_single (labelled, for reference);
  compute_only               one rank's GEMMs and attention with each all-to-all replaced by a view
                             of the same elements as the shape it would produce: no communication.

The regime sets the hidden size h (the projections' GEMMs scale with it, the all-to-alls do not) so
that T_comm / T_comp reaches ``--ratios`` (compute-only probed at two sizes, fitted linearly).
Started by ``benchmarks.flash_overlap.overlap`` with torch.distributed's variables set.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.flash_overlap.rank import _timed
from benchmarks.flash_overlap.same_transport import deepspeed_on_p2p, p2p_all_to_all_single
from megatron_ext.layers.p2p_link import OverlapGroup
from megatron_ext.layers.ulysses import HeadSplit, ulysses_attention

METHODS = ("distributed_attention_gloo", "distributed_attention_p2p", "ulysses_flash_overlap")


@dataclass(frozen=True)
class Sizes:
    """Sizes of the timed attention block (multi-head: as many key/value heads as query heads)."""

    seq_per_rank: int
    """Tokens per rank (s/n)."""
    batch: int
    """Micro-batch size b."""
    hidden: int
    """Hidden size h: the projections' input/output width."""
    heads: int
    """Attention heads (a multiple of the sequence-parallel size)."""
    head_dim: int
    """Channels per head."""


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of [s, b, heads, d] over the whole sequence; [s, b, heads * d] out."""
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True)
    return out.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)


class UlyssesBlock(torch.nn.Module):
    """One method's attention block on the WORLD group; ``step()`` runs forward + backward."""

    def __init__(self, method: str, sizes: Sizes, seed: int = 0) -> None:
        super().__init__()
        n, r = dist.get_world_size(), dist.get_rank()
        g = torch.Generator().manual_seed(seed)
        c = sizes.heads * sizes.head_dim
        s = sizes.seq_per_rank * n
        self.w_qkv = torch.nn.Parameter(torch.randn(3 * c, sizes.hidden, generator=g) / sizes.hidden**0.5)
        self.w_out = torch.nn.Parameter(torch.randn(sizes.hidden, c, generator=g) / c**0.5)
        x = torch.randn(s, sizes.batch, sizes.hidden, generator=g)
        cotangent = torch.randn(s, sizes.batch, sizes.hidden, generator=g)
        rows = slice(r * sizes.seq_per_rank, (r + 1) * sizes.seq_per_rank)
        self.x, self.cotangent = x[rows].contiguous(), cotangent[rows].contiguous()
        self.method, self.sizes = method, sizes
        self.split = HeadSplit(sizes.heads, sizes.heads, sizes.head_dim, n)
        self.og = OverlapGroup(dist.group.WORLD, "direct", name="ulysses_attention")
        if method.startswith("distributed_attention"):
            import deepspeed
            from deepspeed.sequence.layer import DistributedAttention

            deepspeed.comm.init_distributed(dist_backend="gloo", verbose=False)

            def per_head(q, k, v):  # DeepSpeed 0.19 takes the context back as [s, b, heads, d]
                return local_attention(q, k, v).view(q.shape)

            self.attention = DistributedAttention(per_head, dist.group.WORLD, scatter_idx=2, gather_idx=0)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.method == "ulysses_flash_overlap":
            return ulysses_attention(x, self.w_qkv, None, self.w_out, local_attention, self.split, self.og)
        mixed = F.linear(x, self.w_qkv)
        if self.method == "compute_only":
            n = self.split.ranks
            full = mixed.view(mixed.shape[0] * n, mixed.shape[1], -1)  # the all-to-all's output shape
            context = local_attention(*self.split.split(full))
            return F.linear(context.view(x.shape[0], x.shape[1], -1), self.w_out)
        d = self.sizes.head_dim
        q, k, v = (part.reshape(*x.shape[:2], -1, d) for part in mixed.chunk(3, dim=-1))
        return F.linear(self.attention(q, k, v, 1, None).flatten(2), self.w_out)

    def step(self) -> torch.Tensor:
        x = self.x.detach().requires_grad_()
        with deepspeed_on_p2p() if self.method == "distributed_attention_p2p" else contextlib.nullcontext():
            out = self._forward(x)
            out.backward(self.cotangent)
        return out


def comm_only(transport: str, sizes: Sizes) -> None:
    """The step's four all-to-alls alone (QKV and context, forward and backward), on ``transport``."""
    c, t = sizes.heads * sizes.head_dim, sizes.seq_per_rank * sizes.batch
    for width in (3 * c, c, c, 3 * c):
        src = torch.empty(t * width)
        move = p2p_all_to_all_single if transport == "p2p" else dist.all_to_all_single
        move(torch.empty_like(src), src)


def _fit_hidden(sizes: Sizes, ratio: float, warmup: int) -> tuple[int, dict]:
    """The hidden size that puts T_comm(P2P) / T_comp at ``ratio`` (minima of short probes; linear fit
    of compute-only at two sizes; rank 0 decides for all)."""
    probe_h = (256, 1024)
    fns = {"comm": lambda: comm_only("p2p", sizes)}
    for h in probe_h:
        block = UlyssesBlock("compute_only", Sizes(**{**asdict(sizes), "hidden": h}))
        fns[f"comp{h}"] = block.step
    t = {k: min(v) for k, v in _timed(fns, warmup, 7).items()}
    slope = (t[f"comp{probe_h[1]}"] - t[f"comp{probe_h[0]}"]) / (probe_h[1] - probe_h[0])
    base = t[f"comp{probe_h[0]}"] - slope * probe_h[0]
    h = (t["comm"] / ratio - base) / max(slope, 1e-12)
    # Clamped to 4x the probed range: under host load a noisy slope can ask for a GEMM many times the
    # probes' (the regime is then reported by its measured ratio, not the requested one).
    decided = torch.tensor([min(4 * probe_h[1], max(64, round(h / 64) * 64))], dtype=torch.int64)
    dist.broadcast(decided, src=0)
    return int(decided.item()), {
        "probe_comm_s": t["comm"],
        "probe_comp_s": {str(h): t[f"comp{h}"] for h in probe_h},
    }


def _check(blocks: dict[str, UlyssesBlock]) -> dict[str, float]:
    """One warm-up step of each method; largest difference of output and gradients from DeepSpeed's."""
    results = {}
    for name, block in blocks.items():
        out = block.step()
        results[name] = [out.detach(), *(p.grad for p in block.parameters())]
        block.zero_grad(set_to_none=True)
    reference = results["distributed_attention_gloo"]
    return {m: max((a - b).abs().max().item() for a, b in zip(r, reference)) for m, r in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-per-rank", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 1.0], help="target T_comm/T_comp")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    result: dict = {"world_size": dist.get_world_size(), "args": vars(args), "regimes": {}}
    for ratio in args.ratios:
        base = Sizes(args.seq_per_rank, args.batch, 0, args.heads, args.head_dim)
        hidden, probe = _fit_hidden(base, ratio, args.warmup)
        sizes = Sizes(**{**asdict(base), "hidden": hidden})
        blocks = {m: UlyssesBlock(m, sizes) for m in (*METHODS, "compute_only")}
        load = [os.getloadavg()[0]]
        check = _check({m: blocks[m] for m in METHODS})
        steps = {name: block.step for name, block in blocks.items()}
        for transport in ("p2p", "collectives"):
            steps[f"comm_only_{transport}"] = lambda t=transport, z=sizes: comm_only(t, z)
        times = _timed(steps, args.warmup, args.steps)
        load.append(os.getloadavg()[0])
        result["regimes"][f"ratio{ratio:g}"] = {
            "sizes": asdict(sizes), **probe, "times": times, "max_abs_diff_vs_distributed_attention": check,
            "load": load,
        }  # fmt: skip
        if dist.get_rank() == 0:
            print(f"UP SP={dist.get_world_size()} ratio {ratio:g}: hidden={hidden} done", flush=True)
    dist.barrier()
    from benchmarks.cluster import write_result

    write_result(result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
