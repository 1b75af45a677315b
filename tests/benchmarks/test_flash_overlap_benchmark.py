"""The Flash-Overlap benchmark's baselines are what they claim: the 4-chunk slicing computes exactly what
megatron-core's linears compute, forward and backward, in the MLP and in a whole layer; and the
compute-only twin holds exactly one rank's weight shapes, so T_comp is that rank's work."""

from __future__ import annotations

import torch


def _blocks_against_megatron_core() -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from benchmarks.flash_overlap.blocks import Block, Shapes
    from megatron_ext.integration.core_on_cpu import enable_cpu_support

    enable_cpu_support()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(0)
    tp, rank = ps.get_tensor_model_parallel_group(), dist.get_rank()
    solo = [dist.new_group([r]) for r in range(2)][rank]
    shapes = Shapes(seq=16, batch=2, hidden=32, heads=4, ffn=64)
    x = torch.randn(shapes.seq, shapes.batch, shapes.hidden, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    out = {}
    for block in ("mlp", "layer"):
        results = {}
        for method in ("megatron_core", "chunked_4", "flash_overlap"):
            torch.manual_seed(0)
            module = Block(block, method, shapes, tp, 2)
            y = module.step(x.chunk(2)[rank].contiguous(), grad.chunk(2)[rank].contiguous())
            results[method] = [y.detach(), *(p.grad for p in module.parameters())]
        reference = results["megatron_core"]
        out[block] = {
            m: max((a - b).abs().max().item() for a, b in zip(r, reference)) for m, r in results.items()
        }
        shard_shapes = [tuple(p.shape) for p in Block(block, "megatron_core", shapes, tp, 2).parameters()]
        twin_shapes = [tuple(p.shape) for p in Block(block, "compute_only", shapes, solo, 2).parameters()]
        out[block]["same_shapes"] = shard_shapes == twin_shapes
    return out


def test_chunked_baseline_equals_megatron_core_and_compute_only_has_one_ranks_shapes(run_ranks):
    for per_rank in run_ranks(2, _blocks_against_megatron_core):
        for block in ("mlp", "layer"):
            assert per_rank[block]["same_shapes"], block
            assert per_rank[block]["chunked_4"] < 1e-5, (block, per_rank[block])
            assert per_rank[block]["flash_overlap"] < 1e-5, (block, per_rank[block])
