"""Backward of the Flash-Overlap layers against megatron-core's and a float64 reference: weight
gradients no less accurate than megatron-core's in bf16, megatron-core's gradient_accumulation_fusion
contract (accumulate into main_grad), and megatron-core's autocast behaviour in both layers."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from tests.helpers.flash_overlap import setup_tp

pytestmark = pytest.mark.numeric  # run again under ONEDNN_MAX_CPU_ISA=AVX2 (scripts/run_tests.sh)

S_LOCAL, BATCH, IN, OUT = 8, 2, 64, 96


def _layers(kind: str, config, flash: bool, **extra):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_ext.layers.linear import FlashOverlapColumnParallelLinear, FlashOverlapRowParallelLinear

    cls = {
        ("column", True): FlashOverlapColumnParallelLinear,
        ("column", False): ColumnParallelLinear,
        ("row", True): FlashOverlapRowParallelLinear,
        ("row", False): RowParallelLinear,
    }[kind, flash]
    args = (
        {"gather_output": False} if kind == "column" else {"input_is_parallel": True, "skip_bias_add": False}
    )
    torch.manual_seed(0)
    return cls(
        IN,
        OUT,
        config=config,
        init_method=partial(torch.nn.init.normal_, std=0.3),
        bias=False,
        keep_master_weight_for_test=True,
        **args,
        **extra,
    )


def _inputs(kind: str, tp: int, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, slice]:
    """This rank's input and output gradient, and the slice of the dense input it holds."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(S_LOCAL * tp, BATCH, IN, generator=gen, dtype=torch.float64)
    g = torch.randn(S_LOCAL * tp, BATCH, OUT, generator=gen, dtype=torch.float64)
    seq = slice(rank * S_LOCAL, (rank + 1) * S_LOCAL)
    part = slice(rank * IN // tp, (rank + 1) * IN // tp)
    if kind == "column":
        cols = slice(rank * OUT // tp, (rank + 1) * OUT // tp)
        return x[seq].to(dtype), g[:, :, cols].to(dtype), seq
    return x[:, :, part].to(dtype), g[seq].to(dtype), part


def _dense_wgrad(kind: str, layer, x: torch.Tensor, g: torch.Tensor, group) -> torch.Tensor:
    """float64 dW of this rank's weight shard from the gathered input or output gradient."""
    parts = (
        [torch.empty_like(x.double()) for _ in range(group.size())]
        if kind == "column"
        else [torch.empty_like(g.double()) for _ in range(group.size())]
    )
    torch.distributed.all_gather(parts, (x if kind == "column" else g).double().contiguous(), group=group)
    full = torch.cat(parts)
    if kind == "column":
        return g.double().flatten(0, 1).t() @ full.flatten(0, 1)
    return full.flatten(0, 1).t() @ x.double().flatten(0, 1)


def _wgrad_errors(tp: int) -> dict:
    from megatron.core.model_parallel_config import ModelParallelConfig

    config, group = setup_tp(tp)
    config = ModelParallelConfig(
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,
        params_dtype=torch.bfloat16,
        sequence_parallel=True,
        bf16=True,
    )
    errors = {}
    for kind in ("column", "row"):
        x, g, _ = _inputs(kind, tp, group.rank(), torch.bfloat16)
        for name, flash in (("ours", True), ("megatron-core", False)):
            layer = _layers(kind, config, flash)
            y, _ = layer(x.clone().requires_grad_())
            y.backward(g)
            want = _dense_wgrad(kind, layer, x, g, group)
            errors[kind, name] = (_rms(layer.weight.grad.double() - want) / _rms(want)).item()
        # Each dW element is one sum of K = S_LOCAL * tp * BATCH exact bf16 products, accumulated in
        # fp32 (in another order by each layer) and rounded once to bf16. Each fp32 sum is within
        # gamma_K = K * 2^-24 of sum |x g| of the exact one, and where the two straddle a rounding
        # midpoint the two bf16 results, one ulp apart, are equally far from the exact value up to
        # twice that: the error magnitudes differ per element by at most 4 gamma_K sum |x g|.
        abs_sums = _dense_wgrad(kind, layer, x.abs(), g.abs(), group)
        errors[kind, "margin"] = (4 * S_LOCAL * tp * BATCH * 2.0**-24 * _rms(abs_sums) / _rms(want)).item()
    return errors


def _rms(t: torch.Tensor) -> torch.Tensor:
    return t.pow(2).mean().sqrt()


def test_wgrad_error_vs_float64_is_no_worse_than_megatron_cores_in_bf16(run_ranks):
    for rank, errors in enumerate(run_ranks(4, _wgrad_errors, 4)):
        for kind in ("column", "row"):
            ours, theirs, margin = errors[kind, "ours"], errors[kind, "megatron-core"], errors[kind, "margin"]
            assert 0 < ours <= theirs + margin, (
                f"rank {rank} {kind}: RMS error {ours:.3e} vs megatron-core {theirs:.3e} (+ {margin:.1e})"
            )


def _fusion(tp: int) -> dict:
    from megatron.core.model_parallel_config import ModelParallelConfig

    _, group = setup_tp(tp)
    config = ModelParallelConfig(
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,
        params_dtype=torch.bfloat16,
        sequence_parallel=True,
        bf16=True,
        gradient_accumulation_fusion=True,
    )
    out = {}
    for kind in ("column", "row"):
        x, g, _ = _inputs(kind, tp, group.rank(), torch.bfloat16)
        layer = _layers(kind, config, flash=True)
        layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=torch.float32)
        layer.weight.grad_added_to_main_grad = False  # as megatron-core's DDP marks its parameters
        for _ in range(2):  # two micro-batches accumulate
            y, _ = layer(x.clone().requires_grad_())
            y.backward(g)
        want = 2 * _dense_wgrad(kind, layer, x, g, group)
        out[kind] = {
            "err": ((layer.weight.main_grad.double() - want).abs().max() / want.abs().max()).item(),
            "flag": layer.weight.grad_added_to_main_grad,
            "placeholder": tuple(layer.weight.grad.shape) == tuple(layer.weight.shape),
        }
        del layer.weight.main_grad
        try:  # refused in forward, before any transfer is posted
            layer(x.clone().requires_grad_())
            out[kind]["missing"] = "no error"
        except RuntimeError as e:
            out[kind]["missing"] = str(e)
    return out


def test_gradient_accumulation_fusion_accumulates_into_main_grad_in_fp32(run_ranks):
    for rank, result in enumerate(run_ranks(2, _fusion, 2)):
        for kind, r in result.items():
            assert r["err"] < 1e-6, f"rank {rank} {kind}: main_grad off the float64 sum by {r['err']:.2e}"
            assert r["flag"] and r["placeholder"], (rank, kind, r)
            assert "main_grad" in r["missing"] and "--no-gradient-accumulation-fusion" in r["missing"], r


def _autocast(tp: int) -> dict:
    from megatron.core.model_parallel_config import ModelParallelConfig

    _, group = setup_tp(tp)
    config = ModelParallelConfig(
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        sequence_parallel=True,
    )
    out = {}
    for kind in ("column", "row"):
        x, g, _ = _inputs(kind, tp, group.rank(), torch.float32)
        ours, ref = _layers(kind, config, flash=True), _layers(kind, config, flash=False)
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, _ = ours(xi)
            y_ref, _ = ref(x.clone())  # megatron-core's backward under CPU autocast fails: forward only
        y.float().backward(g)
        want_w = _dense_wgrad(kind, ours, x.bfloat16().float(), g.bfloat16().float(), group)
        out[kind] = {
            "dtypes": (y.dtype, y_ref.dtype, xi.grad.dtype, ours.weight.grad.dtype),
            "fwd_err": ((y.double() - y_ref.double()).abs().max() / y_ref.double().abs().max()).item(),
            "wgrad_err": ((ours.weight.grad.double() - want_w).abs().max() / want_w.abs().max()).item(),
        }
    return out


def test_autocast_runs_both_layers_in_its_dtype_as_megatron_core_does(run_ranks):
    for rank, result in enumerate(run_ranks(2, _autocast, 2)):
        for kind, r in result.items():
            # bf16 output as megatron-core's; gradients in the dtypes of the input and the weight
            assert r["dtypes"] == (torch.bfloat16, torch.bfloat16, torch.float32, torch.float32), (
                rank,
                kind,
                r,
            )
            assert r["fwd_err"] < 1e-2 and r["wgrad_err"] < 2e-2, (rank, kind, r)
