"""Flash-Overlap's Ulysses hook with Megatron-DeepSpeed's flash attention, against stock
``DistributedAttention`` run as upstream runs its flash path at SP > 1 (q, k, v rearranged to
[b, s, heads, d], ``batch_dim_idx`` 0, ``gather_idx`` 1 for FlashSelfAttention; [s, b, ...] for
the triton module), forward and backward at SP = 2 and 4. flash_attn does not install on CPU: the
flash modules are stand-ins with upstream's signatures (causal, no mask), and a lent GPU runs the
real ones."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ext.integration.upstream.megatron_deepspeed import _flash, per_head_attention
from megatron_ext.layers.p2p.link import OverlapGroup
from megatron_ext.layers.ulysses import HeadSplit, ulysses_attention
from tests.helpers.attention import relative_error

pytestmark = pytest.mark.numeric  # run again under ONEDNN_MAX_CPU_ISA=AVX2 (scripts/run_tests.sh)

SEQ, BATCH, HIDDEN, HEADS, HEAD_DIM = 32, 2, 64, 8, 8


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of [b, s, heads, d] tensors, returned as [b, s, heads, d]."""
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    return out.transpose(1, 2)


class FlashSelfAttention(torch.nn.Module):
    """Stand-in for upstream's: forward(q, k, v [b, s, heads, d]) -> [b, s, heads, d], causal."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _causal(q, k, v)


class FlashSelfAttentionTriton(torch.nn.Module):
    """Stand-in for upstream's: forward(q, k, v [s, b, heads, d]) -> [s, b, heads * d], causal."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = _causal(*(t.transpose(0, 1) for t in (q, k, v)))
        return out.transpose(0, 1).flatten(2)


def _run(path: str, triton: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    width = 3 * HEADS * HEAD_DIM
    x_all = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    w_qkv = (torch.randn(width, HIDDEN, generator=g) / HIDDEN**0.5).requires_grad_()
    w_out = (torch.randn(HIDDEN, HEADS * HEAD_DIM, generator=g) / HIDDEN**0.5).requires_grad_()
    cotangent = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    n, r = dist.get_world_size(), dist.get_rank()
    rows = slice(r * SEQ // n, (r + 1) * SEQ // n)
    x = x_all[rows].clone().requires_grad_()
    flash = FlashSelfAttentionTriton() if triton else FlashSelfAttention()
    local = per_head_attention(flash)  # what ParallelAttention hands DistributedAttention
    if path == "ours":
        attention = SimpleNamespace(dist_attn=SimpleNamespace(local_attn=local), use_flash_attn_triton=triton)
        og = OverlapGroup(dist.group.WORLD, timeout_s=60)
        split = HeadSplit(HEADS, HEADS, HEAD_DIM, n)
        out = ulysses_attention(x, w_qkv, None, w_out, _flash(attention), split, og, None)
    else:
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention

        deepspeed.comm.init_distributed(dist_backend="gloo")
        q, k, v = F.linear(x, w_qkv).view(x.shape[0], BATCH, 3, HEADS, HEAD_DIM).unbind(2)
        if triton:  # upstream: [s, b, ...] in, [s, b, heads * d] out
            dist_attn = DistributedAttention(local, dist.group.WORLD, gather_idx=0)
            context = dist_attn(q, k, v, 1).flatten(2)
        else:  # upstream: rearrange 's b ... -> b s ...', batch_dim_idx 0, back to [s, b, heads * d]
            dist_attn = DistributedAttention(local, dist.group.WORLD, gather_idx=1)
            q, k, v = (t.transpose(0, 1).contiguous() for t in (q, k, v))
            context = dist_attn(q, k, v, 0).transpose(0, 1).flatten(2)
        out = F.linear(context, w_out)
    (out * cotangent[rows]).sum().backward()
    return {"out": out.detach(), "x": x.grad, "w_qkv": w_qkv.grad, "w_out": w_out.grad}


def _compare(triton: bool) -> dict[str, float]:
    ours, stock = _run("ours", triton), _run("stock", triton)
    return {key: relative_error(ours[key], stock[key]) for key in ours}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("triton", [False, True], ids=["flash", "flash-triton"])
def test_flash_attention_through_the_hook_matches_stock_ulysses_flash_path(run_ranks, world, triton):
    for errors in run_ranks(world, _compare, triton, timeout=120):
        assert max(errors.values()) < SEQ * BATCH * torch.finfo(torch.float32).eps, errors
