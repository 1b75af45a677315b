"""Ulysses attention's sums: against a float64 reference, our output and gradients are as accurate
as DeepSpeed's ``DistributedAttention`` around the same projections, at sequence-parallel sizes 2
and 4 and real layers' sizes (sequence 512; 8 heads of 64, and 8 query / 4 key-value heads of 128),
with a padding mask, in bf16 and fp32.

Both paths round the same exact products, summed in fp32, to the dtype; they differ only in the
order of those sums (ours per head group, DeepSpeed's in one GEMM whose kernel depends on the CPU:
oneDNN's AVX-512, AMX or AVX2 blocking). Where the two fp32 sums of one element straddle a rounding
boundary of the dtype, the two results are one ulp apart there, so "as accurate" is checked as:

- per output and gradient, ours <= DeepSpeed's + ULPS[dtype] ulps of the dtype at the reference's
  largest magnitude (the errors are normalised by it): one flipped rounding of the result, plus,
  in fp32 (where every element's sum differs in order, not only near a boundary), one of the
  intermediate that feeds it;
- over every output, gradient, case and size, the geometric mean of ours / DeepSpeed's <= 1 + 2^-8:
  a systematic loss of accuracy fails it (one more bf16 rounding of a partial sum gave 1.12-1.44x),
  the flips above do not (they go either way: on a CPU with AMX, components moved by -1.7 % to
  +1.7 %, which leaves the mean of 20 within 2^-8 of 1, not always below it).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ext.layers.p2p.link import OverlapGroup
from megatron_ext.layers.ulysses import HeadSplit, ulysses_attention
from tests.helpers.attention import local_attention

pytestmark = pytest.mark.numeric  # run again under ONEDNN_MAX_CPU_ISA=AVX2 (scripts/run_tests.sh)

SEQ, BATCH, PADDING = 512, 1, 48
# name -> (heads, kv_heads, head_dim); hidden = heads x head_dim (512 and 1024)
CASES = {"mha-d64": (8, 8, 64), "gqa-d128": (8, 4, 128)}
KEYS = ("out", "x", "w_qkv", "b_qkv", "w_out")


def _inputs(heads: int, kv_heads: int, d: int) -> dict[str, torch.Tensor]:
    """float64 masters; the last PADDING tokens are padding no query attends to."""
    g = torch.Generator().manual_seed(2024)
    hidden, width = heads * d, (heads + 2 * kv_heads) * d
    padded = torch.zeros(SEQ, SEQ, dtype=torch.bool)
    padded[:, SEQ - PADDING :] = True
    return {
        "x": torch.randn(SEQ, BATCH, hidden, generator=g, dtype=torch.float64),
        "w_qkv": torch.randn(width, hidden, generator=g, dtype=torch.float64) / hidden**0.5,
        "b_qkv": torch.randn(width, generator=g, dtype=torch.float64) * 0.1,
        "w_out": torch.randn(hidden, heads * d, generator=g, dtype=torch.float64) / hidden**0.5,
        "cotangent": torch.randn(SEQ, BATCH, hidden, generator=g, dtype=torch.float64),
        "mask": padded.expand(BATCH, 1, SEQ, SEQ),
    }


def _run(path: str, case: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """This rank's output and gradients in float64: ours or DeepSpeed's in ``dtype``, or the
    float64 reference (one rank, the whole sequence; weight gradients summed over ranks after)."""
    heads, kv_heads, d = CASES[case]
    t = _inputs(heads, kv_heads, d)
    n, r = (1, 0) if path == "reference" else (dist.get_world_size(), dist.get_rank())
    rows = slice(r * SEQ // n, (r + 1) * SEQ // n)
    x = t["x"][rows].to(dtype).requires_grad_()
    w_qkv, b_qkv, w_out = (t[k].to(dtype).requires_grad_() for k in ("w_qkv", "b_qkv", "w_out"))
    if path == "ours":
        og = OverlapGroup(dist.group.WORLD, timeout_s=60)
        out = ulysses_attention(
            x, w_qkv, b_qkv, w_out, local_attention, HeadSplit(heads, kv_heads, d, n), og, t["mask"]
        )
    else:
        mixed = F.linear(x, w_qkv, b_qkv)
        q_end, k_end = heads * d, (heads + kv_heads) * d
        q, k, v = (
            part.reshape(part.shape[0], BATCH, -1, d)
            for part in (mixed[..., :q_end], mixed[..., q_end:k_end], mixed[..., k_end:])
        )
        if path == "deepspeed":
            import deepspeed
            from deepspeed.sequence.layer import DistributedAttention

            deepspeed.comm.init_distributed(dist_backend="gloo")

            def per_head(q, k, v, mask):
                return local_attention(q, k, v, mask).view(q.shape)

            context = DistributedAttention(per_head, dist.group.WORLD, scatter_idx=2, gather_idx=0)(
                q, k, v, 1, None, t["mask"]
            ).flatten(2)
        else:
            context = local_attention(q, k, v, t["mask"])
        out = F.linear(context, w_out)
    (out * t["cotangent"][rows].to(dtype)).sum().backward()
    got = {"out": out, "x": x.grad, "w_qkv": w_qkv.grad, "b_qkv": b_qkv.grad, "w_out": w_out.grad}
    return {k: v.detach().double() for k, v in got.items()}


def _errors(case: str, dtype: torch.dtype) -> dict[str, tuple[float, float]]:
    """Per output and gradient: (ours, DeepSpeed's) largest error over the reference's largest magnitude."""
    ours, deepspeed = _run("ours", case, dtype), _run("deepspeed", case, dtype)
    reference = _run("reference", case, dtype=torch.float64)
    n, r = dist.get_world_size(), dist.get_rank()
    rows = slice(r * SEQ // n, (r + 1) * SEQ // n)
    out = {}
    for key in KEYS:
        want = reference[key][rows] if key in ("out", "x") else reference[key]
        if key not in ("out", "x"):  # each rank holds its tokens' part of a weight gradient
            dist.all_reduce(ours[key])
            dist.all_reduce(deepspeed[key])
        scale = want.abs().max().item()
        out[key] = tuple(((got - want).abs().max() / scale).item() for got in (ours[key], deepspeed[key]))
    return out


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# The dtype's ulp at 1.0 (2^-7 for bf16's 8 significant bits, 2^-23 for fp32's 24), and how many
# of them the two paths' errors may differ by (see the module docstring).
ULP = {torch.bfloat16: 2.0**-7, torch.float32: 2.0**-23}
ULPS = {torch.bfloat16: 1, torch.float32: 2}


def _all_errors(dtype_name: str) -> dict[str, tuple[float, float]]:
    """'case key' -> (ours, DeepSpeed's) error, each the largest over this rank's rows."""
    return {
        f"{case} {key}": pair for case in CASES for key, pair in _errors(case, DTYPES[dtype_name]).items()
    }


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_sums_are_as_accurate_as_distributed_attentions(run_ranks, dtype_name):
    dtype, ratios = DTYPES[dtype_name], []
    for world in (2, 4):
        per_rank = run_ranks(world, _all_errors, dtype_name, timeout=600)
        for name in per_rank[0]:
            ours = max(errors[name][0] for errors in per_rank)
            deepspeed = max(errors[name][1] for errors in per_rank)
            print(f"SP={world} {name} {dtype_name}: ours {ours:.4e} deepspeed {deepspeed:.4e}")
            assert ours <= deepspeed + ULPS[dtype] * ULP[dtype], (world, name, ours, deepspeed)
            ratios.append(ours / deepspeed)
    geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
    print(f"{dtype_name}: geometric mean of ours / DeepSpeed's over {len(ratios)} errors: {geomean:.4f}")
    assert geomean <= 1 + 2.0**-8, ratios
