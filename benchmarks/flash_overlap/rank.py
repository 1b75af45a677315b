"""One rank of the Flash-Overlap benchmark: forward + backward of the MLP and of a whole transformer
layer under each method, side by side, with the compute-only and transfer-only runs of the same shapes.

Started by ``benchmarks.flash_overlap.run`` (loopback) or by the emulated cluster's launcher, with
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set; the rank's result goes through ``write_result``.

Method in full: benchmarks/results/methods.md, `benchmarks.flash_overlap.rank`.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist

from benchmarks.cluster import write_result
from benchmarks.device import StandIn, add_device_flags, stand_in
from benchmarks.flash_overlap import probes
from benchmarks.flash_overlap.blocks import BLOCKS, METHODS, WHOLE_SEQUENCE, Block, Shapes
from benchmarks.flash_overlap.domino import DominoStack
from mdsp_base.shutdown import exit_without_teardown

REGIMES = ("hideable", "balanced", "fixed")
"""How the MLP width is chosen: tuned so that fc1's slice compute is 2x its slice transfer (hideable) or
(N-1)/N of it (balanced), or ``--ffn`` as given (fixed: a preset's real shapes)."""
COMPUTE_OPS = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::gelu",
    "aten::gelu_backward",
    "aten::native_layer_norm",
    "aten::native_layer_norm_backward",
    "aten::_softmax",
    "aten::_softmax_backward_data",
}
"""The profiled ops counted as compute for the in-step figure and the timelines (outermost only)."""


def _timed(
    fns: dict[str, Callable[[], object]],
    warmup: int,
    steps: int,
    device: AbstractContextManager | None = None,
    charged: dict[str, list[tuple[int, float]]] | None = None,
) -> dict[str, list[float]]:
    """Every function warmup + steps times, interleaved step by step (load drifts on a shared host hit
    all alike: the pairs of a paired comparison), each after a barrier and without garbage collection
    inside; the timed steps' seconds. ``device``: a stand-in entered around each step, whose exit
    waits for its virtual device as ``torch.cuda.synchronize`` would; ``charged`` (with a stand-in)
    receives each timed step's device kernels and busy seconds per function."""
    out: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(warmup + steps):
        for name, fn in fns.items():
            gc.collect()
            gc.disable()
            dist.barrier()
            before = _charged(device)
            start = time.perf_counter()
            with device if device is not None else nullcontext():
                fn()
            elapsed = time.perf_counter() - start
            gc.enable()
            if i >= warmup:
                out[name].append(elapsed)
                if charged is not None and before is not None:
                    after = _charged(device)
                    charged.setdefault(name, []).append((after[0] - before[0], after[1] - before[1]))
    return out


def device_per_step(charged: dict[str, list[tuple[int, float]]]) -> dict[str, dict[str, float]]:
    """Per function, the median over timed steps of its device kernels and busy seconds."""
    return {
        name: {"kernels": statistics.median(k for k, _ in c), "busy_s": statistics.median(b for _, b in c)}
        for name, c in charged.items()
    }


def _charged(device: AbstractContextManager | None) -> tuple[int, float] | None:
    """The stand-in's kernels and busy seconds so far (None on the host)."""
    if not isinstance(device, StandIn):
        return None
    return device.stats.ops, device.stats.busy_s


def _profiled(fn) -> dict:
    """One more step under torch.profiler: its time and its outermost compute ops (ms from its start)."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
    events = [e for e in prof.events() if e.name in COMPUTE_OPS]
    origin = min((e.time_range.start for e in prof.events()), default=0)

    def nested(e) -> bool:
        parent = e.cpu_parent
        while parent is not None:
            if parent.name in COMPUTE_OPS:
                return True
            parent = parent.cpu_parent
        return False

    spans = sorted(
        (
            e.name.removeprefix("aten::"),
            (e.time_range.start - origin) / 1e3,
            (e.time_range.end - origin) / 1e3,
        )
        for e in events
        if not nested(e)
    )
    return {"step_s": elapsed, "compute_s": sum(b - a for _, a, b in spans) / 1e3, "spans": spans}


def _tune_ffn(
    regime: str, shapes: Shapes, group: dist.ProcessGroup, warmup: int, device: StandIn | None
) -> tuple[int, dict]:
    """The MLP width that puts fc1's per-slice compute c at the regime's multiple of the slice transfer p
    (minima of short probes, on the stand-in when there is one; rank 0 decides for all)."""
    n = group.size()
    shard = torch.randn(shapes.seq // n, shapes.batch, shapes.hidden, dtype=_dtype(device))
    full = shard.new_empty((shapes.seq, shapes.batch, shapes.hidden))
    gather = _timed({"p": lambda: probes.p2p_exchange("all_gather", shard, full, group)}, warmup, 7)["p"]
    p = min(gather) / (n - 1)
    columns = 256
    per_column = probes.gemm_times(
        probes.Linear("probe", True, shapes.hidden, columns),
        shard.numel() // shapes.hidden,
        shard.dtype,
        device,
    )
    per_column = per_column["fwd"] / columns  # one slice: s/N rows
    c = 2 * p if regime == "hideable" else (n - 1) * p / n
    decided = torch.tensor([max(1, round(c / per_column)) * n], dtype=torch.int64)
    dist.broadcast(decided, src=0, group=group)
    return int(decided.item()), {"probe_p_s": p, "probe_c_target_s": c}


def _check(modules: dict[str, Block], shard: torch.Tensor, grad: torch.Tensor) -> dict[str, float]:
    """One warm-up step of each method (equal weights); largest difference of its output and gradients
    from megatron-core's on gloo: the baselines compute what they replace."""
    results = {}
    for name, module in modules.items():
        if name in WHOLE_SEQUENCE:  # its own layers and weights: not the same function's values
            continue
        out = module.step(shard, grad)
        results[name] = [out.detach(), *(p.grad for p in module.parameters())]
        module.zero_grad(set_to_none=True)
    reference = results.get("megatron_core")
    if reference is None:
        return {}
    return {m: max((a - b).abs().max().item() for a, b in zip(r, reference)) for m, r in results.items()}


def _dtype(device: StandIn | None) -> torch.dtype:
    """bf16 on a stand-in GPU, as GPUs train (its matmuls charged at the bf16 rate); fp32 on the
    host, which its CPU runs fastest."""
    return torch.float32 if device is None else torch.bfloat16


def _layers(block: str, shapes: Shapes) -> int:
    """Transformer layers in ``block``: the stack's, one, or none (the MLP alone counts as one)."""
    return shapes.layers if block == "layers" else 1


def _run_block(block: str, shapes: Shapes, tp_group, args, device: StandIn | None) -> dict:
    n, rank = tp_group.size(), tp_group.rank()
    dtype = _dtype(device)
    torch.manual_seed(0)
    x = torch.randn(shapes.seq, shapes.batch, shapes.hidden, dtype=dtype)
    shard, grad_full = x.chunk(n)[rank].contiguous(), torch.ones_like(x)
    grad_shard = grad_full.chunk(n)[rank].contiguous()
    modules: dict[str, torch.nn.Module] = {}
    with nullcontext() if device is None else device.building():  # a stand-in's weights: untouched
        for method in args.methods:
            torch.manual_seed(1)  # equal weights in every method, for _check
            if method not in WHOLE_SEQUENCE:
                modules[method] = Block(block, method, shapes, tp_group, n, dtype, args.compute_slices)
            elif block != "mlp":  # Domino's unit is the whole layer
                modules[method] = DominoStack(shapes, _layers(block, shapes), tp_group, dtype)
        compute = Block(block, "compute_only", shapes, tp_group, n, dtype)
    load = [os.getloadavg()[0]]
    # a stand-in computes no values: there is nothing to compare
    check = _check(modules, shard, grad_shard) if device is None else {}
    inputs = {m: (x, grad_full) if m in WHOLE_SEQUENCE else (shard, grad_shard) for m in modules}
    steps = {method: (lambda m=module, a=inputs[method]: m.step(*a)) for method, module in modules.items()}
    steps["compute_only"] = lambda: compute.step(shard, grad_shard)
    pairs = 1 if block == "mlp" else 2 * _layers(block, shapes)
    for transport in probes.TRANSPORTS:
        steps[f"comm_only_{transport}"] = lambda t=transport: probes.comm_only(t, pairs, shard, tp_group)
    charged: dict[str, list[tuple[int, float]]] = {}
    times = _timed(steps, args.warmup, args.steps, device, charged)
    load.append(os.getloadavg()[0])
    # the profiler sees host compute ops, which a stand-in does not run
    names = (*args.methods, "compute_only") if device is None else ()
    profiled = {name: _profiled(steps[name]) for name in names}
    tokens = shapes.seq * shapes.batch
    gemms = {
        lin.name: {"column": lin.column, **probes.gemm_times(lin, tokens, dtype, device)}
        for lin in probes.linears(block, shapes, n)
    }
    return {
        "times": times, "profiled": profiled, "gemms": gemms, "pairs": pairs, "layers": _layers(block, shapes),
        "device_per_step": device_per_step(charged),
        "max_abs_diff_vs_megatron_core": check, "load": load,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--seq-per-rank", type=int, default=96, help="sequence slice per rank (multiple of 4)"
    )
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12, help="attention heads of the layer (multiple of TP)")
    parser.add_argument("--blocks", nargs="+", choices=BLOCKS, default=["mlp", "layer"])
    parser.add_argument("--layers", type=int, default=4, help="layers of the layers block")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--regimes", nargs="+", choices=REGIMES, default=list(REGIMES))
    parser.add_argument("--ffn", type=int, default=None, help="fixed MLP width instead of tuning per regime")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--compute-slices",
        type=int,
        default=0,
        help="GEMMs per collective of flash_overlap_merged (2 and up)",
    )
    add_device_flags(parser)
    args = parser.parse_args()
    if args.seq_per_rank % 4:
        parser.error(f"--seq-per-rank {args.seq_per_rank} must be a multiple of 4 (chunked_4 cuts it in 4)")
    if "fixed" in args.regimes and args.ffn is None:
        parser.error("--regimes fixed keeps the MLP width as given: pass --ffn")
    if "flash_overlap_merged" in args.methods and args.compute_slices < 2:
        parser.error(f"flash_overlap_merged needs --compute-slices 2 or more (got {args.compute_slices})")
    if "domino_p2p" in args.methods and args.batch % 2:
        parser.error(f"domino_p2p splits the micro-batch in two halves: --batch {args.batch} must be even")

    warnings.filterwarnings("ignore")  # gloo's tensor collectives warn on every call in torch 2.13
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_ext.integration.core_on_cpu import enable_cpu_support

    enable_cpu_support()
    n = dist.get_world_size()
    if args.heads % n:
        parser.error(f"--heads {args.heads} must be a multiple of the TP size {n}")
    ps.initialize_model_parallel(tensor_model_parallel_size=n, create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(0)
    tp_group = ps.get_tensor_model_parallel_group()
    device = stand_in(args)
    result: dict = {"world_size": n, "args": vars(args), "regimes": {}}
    for regime in args.regimes:
        base = Shapes(args.seq_per_rank * n, args.batch, args.hidden, args.heads, args.ffn or n, args.layers)
        ffn, probe = (args.ffn, {}) if args.ffn else _tune_ffn(regime, base, tp_group, args.warmup, device)
        shapes = Shapes(base.seq, base.batch, base.hidden, base.heads, ffn, base.layers)
        blocks = {block: _run_block(block, shapes, tp_group, args, device) for block in args.blocks}
        result["regimes"][regime] = {"ffn": ffn, **probe, "blocks": blocks}
        if dist.get_rank() == 0:
            print(f"regime {regime}: ffn={ffn} done", flush=True)
    result["device"] = None if device is None else device.describe()
    dist.barrier()
    write_result(result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
