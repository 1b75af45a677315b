"""Flash-Overlap's CUDA path on one GPU: the layers equal megatron-core's at TP=1 in bf16 (error vs
float64 no larger), a CUDA graph captures them, and the TP=2 schedules (over a fake process group,
since one GPU cannot hold an NCCL pair) make no synchronising call, wait on the stream only, keep
the paper's order (own slice first when gathering, last when reducing) and are capturable."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
S, B, H, F = 256, 2, 512, 1024


def _pair(config, flash: bool):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megatron_ext.layers.linear import FlashOverlapColumnParallelLinear, FlashOverlapRowParallelLinear

    column, row = (
        (FlashOverlapColumnParallelLinear, FlashOverlapRowParallelLinear)
        if flash
        else (ColumnParallelLinear, RowParallelLinear)
    )
    init = torch.nn.init.xavier_normal_
    return (
        column(H, F, config=config, init_method=init, bias=True, gather_output=False),
        row(F, H, config=config, init_method=init, bias=True, input_is_parallel=True, skip_bias_add=False),
    )


def _mlp(pair, x):
    return pair[1](torch.nn.functional.gelu(pair[0](x)[0]))[0]


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b).abs().max().item()


def test_layers_match_megatron_core_at_tp1_in_bf16(cuda_rank):
    from megatron.core.model_parallel_config import ModelParallelConfig

    config = ModelParallelConfig(params_dtype=torch.bfloat16, bf16=True)
    ref, ours = _pair(config, flash=False), _pair(config, flash=True)
    for a, b in zip(ref, ours):
        b.load_state_dict(a.state_dict())
    x = torch.randn(S, B, H, device=cuda_rank, dtype=torch.bfloat16)
    dense = [(layer.weight.detach().double().requires_grad_(), layer.bias.detach().double()) for layer in ref]
    xd = x.double().requires_grad_()
    want = _mlp([lambda t, p=p: (torch.nn.functional.linear(t, *p), None) for p in dense], xd)
    grad = torch.randn_like(want)
    want.backward(grad)
    errors, outputs = {}, {}
    for name, pair in (("megatron-core", ref), ("flash-overlap", ours)):
        xi = x.clone().requires_grad_()
        out = _mlp(pair, xi)
        out.backward(grad.to(out.dtype))
        outputs[name] = out.detach()
        errors[name] = {
            "out": _max_err(out, want),
            "dgrad": _max_err(xi.grad, xd.grad),
            "wgrad": max(_max_err(layer.weight.grad, w.grad) for layer, (w, _) in zip(pair, dense)),
        }
    print(json.dumps(errors))
    for key in ("out", "dgrad", "wgrad"):  # the same GEMMs: no larger error than megatron-core's
        assert errors["flash-overlap"][key] <= errors["megatron-core"][key] * 1.001 + 1e-9, errors
    assert torch.equal(outputs["flash-overlap"], outputs["megatron-core"])


def test_gradient_accumulation_fusion_sums_bf16_wgrads_in_fp32_main_grad(cuda_rank):
    from megatron.core.model_parallel_config import ModelParallelConfig

    config = ModelParallelConfig(params_dtype=torch.bfloat16, bf16=True, gradient_accumulation_fusion=True)
    pair = _pair(config, flash=True)
    for layer in pair:
        layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=torch.float32, device=cuda_rank)
        layer.weight.grad_added_to_main_grad = False
    x = torch.randn(S, B, H, device=cuda_rank, dtype=torch.bfloat16)
    grads = [torch.randn(S, B, H, device=cuda_rank, dtype=torch.bfloat16) for _ in range(2)]
    hidden = torch.nn.functional.gelu(pair[0](x)[0]).detach()
    for g in grads:  # two micro-batches
        _mlp(pair, x).backward(g)
    want = sum(g.double().flatten(0, 1).t() @ hidden.double().flatten(0, 1) for g in grads)
    err = ((pair[1].weight.main_grad.double() - want).abs().max() / want.abs().max()).item()
    assert err < 1e-3, err  # bf16 products summed in fp32
    assert pair[0].weight.main_grad.abs().sum() > 0 and all(
        layer.weight.grad_added_to_main_grad for layer in pair
    )


def test_a_cuda_graph_captures_the_layers_at_tp1(cuda_rank):
    from megatron.core.model_parallel_config import ModelParallelConfig

    pair = _pair(ModelParallelConfig(params_dtype=torch.bfloat16, bf16=True), flash=True)
    static_x = torch.randn(S, B, H, device=cuda_rank, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():  # warm-up off the default stream, as capture requires
        _mlp(pair, static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        static_out = _mlp(pair, static_x)
    x = torch.randn_like(static_x)
    static_x.copy_(x)
    graph.replay()
    with torch.no_grad():
        assert torch.equal(static_out, _mlp(pair, x))


def _replays_match_eager(graphed, eager, device) -> None:
    """Three inputs through the graphed callable and the eager module: equal outputs and input
    gradients (bf16; SDPA's backward may use atomics)."""
    for seed in range(3):
        g = torch.Generator(device=device).manual_seed(seed)
        x = torch.randn(S, B, H, device=device, generator=g).bfloat16()
        cotangent = torch.randn(S, B, H, device=device, generator=g).bfloat16()
        results = []
        for module in (graphed, eager):
            xi = x.clone().requires_grad_()
            out = module(xi)
            out.backward(cotangent)
            results.append((out.detach(), xi.grad))
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)


def test_a_cuda_graph_captures_the_layers_forward_and_backward_at_tp1(cuda_rank):
    """The Flash-Overlap MLP pair under ``torch.cuda.make_graphed_callables``, forward and backward."""
    from megatron.core.model_parallel_config import ModelParallelConfig

    config = ModelParallelConfig(params_dtype=torch.bfloat16, bf16=True)

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.pair = torch.nn.ModuleList(_pair(config, flash=True))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _mlp(self.pair, x)

    eager, block = MLP().to(cuda_rank), MLP().to(cuda_rank)
    block.load_state_dict(eager.state_dict())
    sample = torch.randn(S, B, H, device=cuda_rank, dtype=torch.bfloat16, requires_grad=True)
    _replays_match_eager(torch.cuda.make_graphed_callables(block, (sample,)), eager, cuda_rank)


def test_tp2_schedules_are_stream_ordered_and_capturable(cuda_rank, tmp_path):
    """Runs in a child process: a fake process group of 2 cannot share this process with NCCL."""
    out = tmp_path / "child.json"
    proc = subprocess.run(
        [sys.executable, __file__, str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(out.read_text())
    assert report["timed_waits"] == 0 and report["untimed_waits"] > 0, report
    assert report["gather_order"][0] == "slice 0", report  # own slice first (rank 0)
    assert report["reduce_order"][-1] == "slice 0", report  # own slice last
    assert report["gather_rel_err"] < 1e-2 and report["reduce_rel_err"] < 1e-2, report
    assert report["captured"] and report["replayed_equal"], report


def _child(path: str) -> None:
    """TP=2 over the fake backend on CUDA tensors: transfers are no-ops, everything else is real."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_ext.layers.p2p.link import OverlapGroup
    from megatron_ext.layers.p2p.overlap import all_gather_compute, compute_reduce_scatter

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    waits = {"timed": 0, "untimed": 0}

    class Recorded:
        def __init__(self, work):
            self.work = work

        def wait(self, timeout=None):
            waits["timed" if timeout is not None else "untimed"] += 1
            return self.work.wait()

    issue = dist.batch_isend_irecv

    def exchange(ops: list) -> list:
        # The peer is taken to hold the same data as this rank: a receive gets what this rank sends
        # (queued on the stream, so capture and ordering are real), else zeros.
        sent = [op.tensor for op in ops if op.op is dist.isend]
        for op in ops:
            if op.op is dist.irecv:
                op.tensor.copy_(sent[0]) if sent else op.tensor.zero_()
        return [Recorded(w) for w in issue(ops)]

    dist.batch_isend_irecv = exchange
    order: list[str] = []

    def trace(kind: str, label: str, *_: float) -> None:
        if kind == "compute":
            order.append(label.split(" ", 1)[1])

    og = OverlapGroup(group=dist.group.WORLD, trace=trace)
    plain = OverlapGroup(group=dist.group.WORLD)
    dev = torch.device("cuda", 0)
    x = torch.randn(128, 4, 256, device=dev, dtype=torch.bfloat16)
    w = torch.randn(512, 256, device=dev, dtype=torch.bfloat16)
    out = torch.empty(256, 4, 512, device=dev, dtype=torch.bfloat16)

    def layer(group: OverlapGroup) -> torch.Tensor:
        all_gather_compute(
            x, lambda js, xj: torch.matmul(xj, w.t(), out=out[js.start * 128 : js.stop * 128]), group
        )
        return compute_reduce_scatter(lambda js: torch.matmul(out[js.start * 128 : js.stop * 128], w), group)

    torch.cuda.set_sync_debug_mode("error")
    result = layer(og)
    torch.cuda.set_sync_debug_mode("default")
    full = torch.cat([x, x]).float() @ w.t().float()  # both ranks hold x: the gathered input is [x; x]
    want = 2 * (full[:128] @ w.float())  # rank 0's slice, summed over the two ranks
    report = {
        "timed_waits": waits["timed"],
        "untimed_waits": waits["untimed"],
        "gather_order": order[:2],
        "reduce_order": order[2:],
        "gather_rel_err": ((out.float() - full).norm() / full.norm()).item(),
        "reduce_rel_err": ((result.float() - want).norm() / want.norm()).item(),
    }
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer(plain)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = layer(plain)
    report["captured"] = True
    graph.replay()
    report["replayed_equal"] = bool(torch.equal(static, layer(plain)))
    with open(path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    _child(sys.argv[1])


def test_ulysses_output_projection_sums_bf16_products_in_fp32_as_one_gemm(cuda_rank):
    """The Ulysses block's partial products on CUDA (``out_dtype``): the GEMM's fp32 accumulator,
    unrounded, so closer to the float64 product than F.linear's bf16 result (rounded once)."""
    from megatron_ext.layers.ulysses import _matmul_fp32

    g = torch.Generator(device=cuda_rank).manual_seed(0)
    a = torch.randn(S, B, H, device=cuda_rank, generator=g).bfloat16()
    w = torch.randn(F, H, device=cuda_rank, generator=g).bfloat16()
    wide = _matmul_fp32(a, w.t())
    assert wide.dtype == torch.float32 and wide.shape == (S, B, F)
    reference = a.double() @ w.double().t()
    assert _max_err(wide, reference) <= _max_err(torch.nn.functional.linear(a, w).float(), reference)


def test_a_cuda_graph_captures_the_ulysses_block_forward_and_backward(cuda_rank):
    """At SP=1 (one GPU) the Ulysses block, forward and backward, under
    ``torch.cuda.make_graphed_callables``: replays give eager's output and gradients."""
    import copy

    from megatron_ext.layers.ulysses import HeadSplit
    from megatron_ext.layers.ulysses_module import UlyssesSelfAttention

    def local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # [s, b, heads, d]
        out = torch.nn.functional.scaled_dot_product_attention(
            *(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True
        )
        return out.permute(2, 0, 1, 3).flatten(2)

    class Block(torch.nn.Module):  # the output with its bias: tensors only, as graphed callables need
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.attention = UlyssesSelfAttention(
                H, HeadSplit(8, 8, H // 8, 1), local, None, device=cuda_rank, dtype=torch.bfloat16
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out, bias = self.attention(x)
            return out + bias

    eager, block = Block(), Block()
    block.load_state_dict(copy.deepcopy(eager.state_dict()))
    sample = torch.randn(S, B, H, device=cuda_rank, dtype=torch.bfloat16, requires_grad=True)
    _replays_match_eager(torch.cuda.make_graphed_callables(block, (sample,)), eager, cuda_rank)
