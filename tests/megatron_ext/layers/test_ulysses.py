"""Ulysses attention with overlapped all-to-alls against DeepSpeed's ``DistributedAttention``
wrapped around the same projections (Megatron-DeepSpeed's Ulysses path: QKV linear, split into
q | k | v heads, DistributedAttention(local attention), output linear), forward and backward, at
sequence-parallel sizes 2 and 4, with multi-head and grouped-query attention and a causal mask;
and against the same attention computed densely on one rank over the whole sequence."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ext.layers.p2p.link import OverlapGroup
from megatron_ext.layers.ulysses import HeadSplit, check_sequence_length, ulysses_attention
from megatron_ext.layers.ulysses_module import UlyssesSelfAttention
from tests.helpers.attention import local_attention, relative_error

pytestmark = pytest.mark.numeric  # run again under ONEDNN_MAX_CPU_ISA=AVX2 (scripts/run_tests.sh)

SEQ, BATCH, HIDDEN, HEAD_DIM = 24, 2, 32, 8


def _inputs(heads: int, kv_heads: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    width = (heads + 2 * kv_heads) * HEAD_DIM
    return {
        "x": torch.randn(SEQ, BATCH, HIDDEN, generator=g),
        "w_qkv": torch.randn(width, HIDDEN, generator=g) / HIDDEN**0.5,
        "b_qkv": torch.randn(width, generator=g),
        "w_out": torch.randn(HIDDEN, heads * HEAD_DIM, generator=g) / (heads * HEAD_DIM) ** 0.5,
        "cotangent": torch.randn(SEQ, BATCH, HIDDEN, generator=g),
        "mask": torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).expand(BATCH, 1, SEQ, SEQ),
    }


def _run(path: str, heads: int, kv_heads: int) -> dict[str, torch.Tensor]:
    """One rank's output and gradients on ``path``: ours, deepspeed's, or dense (one rank, whole sequence)."""
    t = _inputs(heads, kv_heads)
    n, r = (1, 0) if path == "dense" else (dist.get_world_size(), dist.get_rank())
    rows = slice(r * SEQ // n, (r + 1) * SEQ // n)
    x = t["x"][rows].clone().requires_grad_()
    w_qkv, b_qkv, w_out = (t[k].clone().requires_grad_() for k in ("w_qkv", "b_qkv", "w_out"))
    if path == "ours":
        split = HeadSplit(heads, kv_heads, HEAD_DIM, n)
        og = OverlapGroup(dist.group.WORLD, timeout_s=60)
        out = ulysses_attention(x, w_qkv, b_qkv, w_out, local_attention, split, og, t["mask"])
    else:
        mixed = F.linear(x, w_qkv, b_qkv)
        q_end, k_end = heads * HEAD_DIM, (heads + kv_heads) * HEAD_DIM
        q, k, v = (
            part.reshape(part.shape[0], BATCH, -1, HEAD_DIM)
            for part in (mixed[..., :q_end], mixed[..., q_end:k_end], mixed[..., k_end:])
        )
        if path == "deepspeed":
            import deepspeed
            from deepspeed.sequence.layer import DistributedAttention

            deepspeed.comm.init_distributed(dist_backend="gloo")  # DistributedAttention talks through it

            def per_head(q, k, v, mask):  # DeepSpeed 0.19 takes the context back as [s, b, heads, d]
                return local_attention(q, k, v, mask).view(q.shape)

            attention = DistributedAttention(per_head, dist.group.WORLD, scatter_idx=2, gather_idx=0)
            context = attention(q, k, v, 1, None, t["mask"]).flatten(2)
        else:
            context = local_attention(q, k, v, t["mask"])
        out = F.linear(context, w_out)
    (out * t["cotangent"][rows]).sum().backward()
    return {"out": out.detach(), "x": x.grad, "w_qkv": w_qkv.grad, "b_qkv": b_qkv.grad, "w_out": w_out.grad}


def _compare(heads: int, kv_heads: int) -> dict[str, float]:
    ours, deepspeed = _run("ours", heads, kv_heads), _run("deepspeed", heads, kv_heads)
    dense = _run("dense", heads, kv_heads)
    n, r = dist.get_world_size(), dist.get_rank()
    rows = slice(r * SEQ // n, (r + 1) * SEQ // n)
    errors = {}
    for key in ours:
        assert ours[key].shape == deepspeed[key].shape, key
        errors[f"deepspeed {key}"] = relative_error(ours[key], deepspeed[key])
    # Weight gradients: each rank holds its tokens' part, the dense run the sum over all of them.
    for key in ("w_qkv", "b_qkv", "w_out"):
        dist.all_reduce(ours[key])
        errors[f"dense {key}"] = relative_error(ours[key], dense[key])
    for key in ("out", "x"):
        errors[f"dense {key}"] = relative_error(ours[key], dense[key][rows])
    return errors


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 4)], ids=["mha", "gqa"])
def test_ulysses_attention_matches_deepspeeds_distributed_attention_forward_and_backward(
    run_ranks, world, heads, kv_heads
):
    for errors in run_ranks(world, _compare, heads, kv_heads, timeout=120):
        # fp32: the same sums in another order. Reordering a sum of n terms moves it by up to about
        # n ulps of its magnitude; the weight gradients sum over SEQ x BATCH tokens. (1e-6 before:
        # on some CPUs the GQA case at 4 ranks measures 1.35e-6.)
        assert max(errors.values()) < SEQ * BATCH * torch.finfo(torch.float32).eps, errors


def test_heads_that_do_not_split_evenly_are_refused_naming_every_factor():
    with pytest.raises(ValueError, match=r"heads=8, kv_heads=2, sequence-parallel size 4: kv_heads=2 is not"):
        HeadSplit(8, 2, HEAD_DIM, 4)
    with pytest.raises(ValueError, match=r"heads=6 is not divisible by sequence-parallel size=4"):
        HeadSplit(6, 6, HEAD_DIM, 4)


def test_a_sequence_length_the_group_cannot_split_is_refused_by_name():
    with pytest.raises(
        ValueError, match=r"sequence length 33 is not divisible by the sequence-parallel size 2"
    ):
        check_sequence_length(33, 2)
    check_sequence_length(32, 2)


def test_the_block_on_one_rank_is_plain_attention_with_its_projections():
    torch.manual_seed(0)
    block = UlyssesSelfAttention(HIDDEN, HeadSplit(4, 2, HEAD_DIM, 1), local_attention, None)
    t = _inputs(4, 2)
    out, bias = block(t["x"], t["mask"])
    mixed = block.query_key_value(t["x"])
    q, k, v = HeadSplit(4, 2, HEAD_DIM, 1).split(mixed)
    expected = F.linear(local_attention(q, k, v, t["mask"]), block.dense.weight)
    torch.testing.assert_close(out, expected)
    assert bias is block.dense.bias


def _module_against_deepspeed(heads: int, kv_heads: int) -> dict[str, float]:
    """The module loads Megatron-DeepSpeed's [q | k | v] weights, computes with them group-major,
    and saves them back in that layout: output, gradients and saved weights against
    ``DistributedAttention`` around the same projections."""
    t, n, r = _inputs(heads, kv_heads), dist.get_world_size(), dist.get_rank()
    rows = slice(r * SEQ // n, (r + 1) * SEQ // n)
    block = UlyssesSelfAttention(
        HIDDEN, HeadSplit(heads, kv_heads, HEAD_DIM, n), local_attention, dist.group.WORLD
    )
    standard = {
        "query_key_value.weight": t["w_qkv"],
        "query_key_value.bias": t["b_qkv"],
        "dense.weight": t["w_out"],
        "dense.bias": torch.zeros(HIDDEN),
    }
    block.load_state_dict(standard)
    saved = block.state_dict()
    x = t["x"][rows].clone().requires_grad_()
    out, _ = block(x, t["mask"])
    (out * t["cotangent"][rows]).sum().backward()
    grads = {"w_qkv": block.query_key_value.weight.grad, "b_qkv": block.query_key_value.bias.grad}
    grads = {k: g.index_select(0, block.split.group_major_order().argsort()) for k, g in grads.items()}
    stock = _run("deepspeed", heads, kv_heads)
    errors = {k: relative_error(v, stock[k]) for k, v in grads.items()}
    errors |= {"out": relative_error(out.detach(), stock["out"]), "x": relative_error(x.grad, stock["x"])}
    errors |= {f"saved {k}": (saved[k] - v).abs().max().item() for k, v in standard.items()}
    return errors


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 4)], ids=["mha", "gqa"])
def test_the_module_holds_qkv_group_major_and_checkpoints_in_megatron_deepspeeds_layout(
    run_ranks, heads, kv_heads
):
    for errors in run_ranks(2, _module_against_deepspeed, heads, kv_heads, timeout=120):
        assert all(errors[f"saved {k}"] == 0 for k in ("query_key_value.weight", "query_key_value.bias")), (
            errors
        )
        assert max(errors.values()) < SEQ * BATCH * torch.finfo(torch.float32).eps, errors


def test_group_major_rows_put_each_destinations_q_k_v_together():
    split = HeadSplit(heads=4, kv_heads=2, head_dim=1, ranks=2)  # rows: q0..q3 | k0 k1 | v0 v1
    assert split.group_major_order().tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    grouped = dataclasses.replace(split, group_major=True)
    assert grouped.qkv_blocks(1) == [(slice(4, 8), slice(0, 4))]
    assert split.qkv_blocks(1) == [
        (slice(2, 4), slice(0, 2)),
        (slice(5, 6), slice(2, 3)),
        (slice(7, 8), slice(3, 4)),
    ]


def _gather_shaped_as_megatron_deepspeeds_ulysses_loss() -> list[float]:
    """[s/n * b] losses gathered into [s, b], as Megatron-DeepSpeed's sequence-parallel loss does."""
    from megatron_ext.integration.upstream.scripts_on_cpu import _gather_by_element_count

    n, r = dist.get_world_size(), dist.get_rank()
    gather = _gather_by_element_count(dist.all_gather_into_tensor)
    out = torch.empty(3 * n, 2)
    gather(out, torch.arange(6, dtype=torch.float32) + 10 * r)
    return out.flatten().tolist()


def test_gloo_gathers_by_element_count_as_nccl_does_for_megatron_deepspeeds_loss(run_ranks):
    # NCCL fills the output's elements rank after rank whatever its shape; gloo alone refuses [6] -> [6, 2].
    with pytest.raises(Exception, match="invalid tensor size"):
        run_ranks(2, _gather_unshimmed)
    expected = [float(x) for x in range(6)] + [float(x) for x in range(10, 16)]
    assert run_ranks(2, _gather_shaped_as_megatron_deepspeeds_ulysses_loss) == [expected, expected]


def _gather_unshimmed() -> None:
    dist.all_gather_into_tensor(torch.empty(6, 2), torch.zeros(6))
