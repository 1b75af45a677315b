"""The same-transport baselines compute what they replace: megatron-core's linears with their collectives
swapped for the P2P exchange, and TransformerEngine's split on P2P, give megatron-core's outputs and
gradients (MLP and whole layer, TP=2 and 4); DeepSpeed's DistributedAttention with its all-to-alls on
P2P gives its unswapped output and gradients; DeepSpeed's Domino layers with their all-reduces on P2P
give their output and gradients on gloo's all-reduce; and every swap is undone on exit."""

from __future__ import annotations

import pytest
import torch

TE_AND_P2P = ("megatron_core_p2p", "te_split_p2p")


def _blocks_against_megatron_core(tp: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import layers, mappings, model_parallel_cuda_manual_seed

    from benchmarks.flash_overlap.blocks import Block, Shapes
    from megatron_ext.integration.core_on_cpu import enable_cpu_support

    enable_cpu_support()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(0)
    group, rank = ps.get_tensor_model_parallel_group(), dist.get_rank()
    shapes = Shapes(seq=16 * tp, batch=2, hidden=32, heads=4, ffn=64)
    x = torch.randn(shapes.seq, shapes.batch, shapes.hidden, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    bound = [layers.dist_all_gather_func, layers.dist_reduce_scatter_func, mappings.dist_all_gather_func]
    out: dict = {}
    for block in ("mlp", "layer"):
        results = {}
        for method in ("megatron_core", *TE_AND_P2P):
            torch.manual_seed(0)
            module = Block(block, method, shapes, group, tp)
            y = module.step(x.chunk(tp)[rank].contiguous(), grad.chunk(tp)[rank].contiguous())
            results[method] = [y.detach(), *(p.grad for p in module.parameters())]
        out[block] = {
            m: max((a - b).abs().max().item() for a, b in zip(r, results["megatron_core"]))
            for m, r in results.items()
        }
    out["restored"] = bound == [
        layers.dist_all_gather_func,
        layers.dist_reduce_scatter_func,
        mappings.dist_all_gather_func,
    ]
    ps.destroy_model_parallel()
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_same_transport_baselines_equal_megatron_core_forward_and_backward(run_ranks, tp):
    for per_rank in run_ranks(tp, _blocks_against_megatron_core, tp, timeout=180):
        assert per_rank["restored"]
        for block in ("mlp", "layer"):
            for method in TE_AND_P2P:
                assert per_rank[block][method] < 1e-5, (block, method, per_rank[block])


def _distributed_attention_on_p2p() -> dict:
    """Every UP method's output and gradients against DistributedAttention on gloo's all-to-all
    (GQA: 8 query, 4 key/value heads), and the swapped functions restored after the steps."""
    import deepspeed.comm as ds_comm
    from deepspeed.accelerator import get_accelerator

    from benchmarks.flash_overlap.ulysses_rank import METHODS, Sizes, UlyssesBlock, agreement

    sizes = Sizes(seq_per_rank=8, batch=2, hidden=32, heads=8, kv_heads=4, head_dim=8)
    originals = (ds_comm.all_to_all_single, get_accelerator().current_stream)
    errors = agreement({method: UlyssesBlock(method, sizes, seed=0) for method in METHODS})
    restored = (ds_comm.all_to_all_single, get_accelerator().current_stream) == originals
    return {"errors": errors, "restored": restored}


@pytest.mark.parametrize("world", [2, 4])
def test_every_ulysses_method_equals_distributed_attention_on_its_gloo_all_to_all(run_ranks, world):
    for per_rank in run_ranks(world, _distributed_attention_on_p2p, timeout=180):
        assert per_rank["restored"]
        assert set(per_rank["errors"]) == {
            "distributed_attention_gloo", "distributed_attention_p2p", "distributed_attention_sp_stream_p2p",
            "ulysses_flash_overlap", "ulysses_group_major",
        }  # fmt: skip
        assert max(per_rank["errors"].values()) < 1e-5, per_rank["errors"]


def _all_reduce_and_domino_on_p2p(tp: int) -> dict:
    """The P2P all-reduce against gloo's on the same tensors, synchronous and overlapped with compute;
    then two steps of DeepSpeed's Domino stack from equal weights, one with its all-reduces on gloo
    (unswapped), one on P2P: the largest differences of outputs and gradients."""
    import deepspeed.comm as ds_comm
    import torch.distributed as dist

    from benchmarks.flash_overlap.blocks import Shapes
    from benchmarks.flash_overlap.domino import DominoStack
    from benchmarks.flash_overlap.same_transport import deepspeed_all_reduce_on_p2p

    rank = dist.get_rank()
    tensors = [
        torch.randn(4 * tp, 3, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(2)
    ]
    expected = [t.clone() for t in tensors]
    for t in expected:
        dist.all_reduce(t)
    original = ds_comm.all_reduce
    with deepspeed_all_reduce_on_p2p():
        handle = ds_comm.all_reduce(tensors[0], async_op=True)
        ds_comm.all_reduce(tensors[1])  # queued behind the first, in issue order
        handle.wait()
    all_reduce = max((a - b).abs().max().item() for a, b in zip(tensors, expected))

    shapes = Shapes(seq=8 * tp, batch=2, hidden=32, heads=4, ffn=64)
    x = torch.randn(shapes.seq, shapes.batch, shapes.hidden, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    results = {}
    for transport in ("gloo", "p2p"):
        torch.manual_seed(0)
        stack = DominoStack(shapes, 2, dist.group.WORLD, torch.float32)
        if transport == "gloo":  # DeepSpeed's own step: its all-reduces unswapped
            x_in = x.detach().requires_grad_()
            y = stack.module(x_in, attention_mask=None)
            y.backward(grad)
        else:
            y = stack.step(x, grad)
        results[transport] = [y.detach(), *(p.grad for p in stack.parameters())]
    domino = max((a - b).abs().max().item() for a, b in zip(results["p2p"], results["gloo"]))
    return {"all_reduce": all_reduce, "domino": domino, "restored": ds_comm.all_reduce is original}


@pytest.mark.parametrize("tp", [2, 4])
def test_domino_on_p2p_equals_domino_on_gloo_and_its_all_reduce_equals_gloo_all_reduce(run_ranks, tp):
    for per_rank in run_ranks(tp, _all_reduce_and_domino_on_p2p, tp, timeout=180):
        assert per_rank["restored"]
        assert per_rank["all_reduce"] < 1e-6, per_rank
        assert per_rank["domino"] < 1e-5, per_rank


def _fused_against_megatron_core_attention() -> float:
    """megatron-core's unfused DotProductAttention and the fused one on the same causal GQA inputs: the
    largest difference of output and input gradients."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from benchmarks.flash_overlap.fused_attention import FusedDotProductAttention
    from megatron_ext.integration.core_on_cpu import enable_cpu_support
    from megatron_ext.integration.gpt import causal_mask

    enable_cpu_support()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(0)  # the unfused attention's dropout forks this generator
    config = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=8, num_query_groups=4, tensor_model_parallel_size=2,
        use_cpu_initialization=True, attention_dropout=0.0,
    )  # fmt: skip
    s, b, d = 12, 2, 8
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(s, b, 4, d, generator=gen)  # this rank's 4 of 8 heads, 2 of 4 key/value groups
    k, v = (torch.randn(s, b, 2, d, generator=gen) for _ in range(2))
    grad = torch.randn(s, b, 4 * d, generator=gen)
    results = []
    for cls in (DotProductAttention, FusedDotProductAttention):
        attention = cls(config, 1, AttnMaskType.causal, "self")
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attention(*inputs, attention_mask=causal_mask(s, "cpu"))
        out.backward(grad)
        results.append([out.detach(), *(t.grad for t in inputs)])
    ps.destroy_model_parallel()
    return max((a - b).abs().max().item() for a, b in zip(*results))


def test_the_fused_attention_equals_megatron_cores_unfused_attention(run_ranks):
    for difference in run_ranks(2, _fused_against_megatron_core_attention, timeout=120):
        assert difference < 1e-5, difference
