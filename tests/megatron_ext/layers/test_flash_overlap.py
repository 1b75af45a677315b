"""Flash-Overlap linears against a dense single-process computation and megatron-core's own layers
(TP=2 and 4, both P2P modes, with and without bias; at TP=4 also with the slices merged into 2 and
3 GEMMs; the symm_mem backend over torch's reference implementations of its fused ops), a GPT
trained with them, the backend choice, and their errors.

All layer cases of one TP size run in one pool call (module-scoped fixture); tests then read them.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
from functools import partial

import pytest
import torch

from megatron_ext.layers.config import FlashOverlapConfig
from multirank import RankError
from tests.helpers.flash_overlap import setup_tp
from tests.helpers.gpt import seeded_gpt

S_LOCAL, BATCH = 3, 5
COL_IN, COL_OUT = 18, 40  # not powers of two; COL_OUT / (TP * stride 2) whole at TP=4
ROW_IN, ROW_OUT = 36, 22
ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce", "sequence_parallel")
MODES = ("direct", "ring")

# (kind, mode, bias, extra constructor options)
CASES = [
    (kind, mode, bias, {}) for kind, mode, bias in itertools.product(("column", "row"), MODES, (True, False))
] + [
    ("column", "ring", True, {"gather_output": True}),
    ("column", "direct", True, {"stride": 2, "skip_bias_add": True}),
    ("row", "ring", True, {"skip_bias_add": True}),
]


def _case_id(case: tuple) -> str:
    kind, mode, bias, extra = case
    return "-".join([kind, mode, "bias" if bias else "nobias", *(f"{k}={v}" for k, v in extra.items())])


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _partition(size: int, tp: int, stride: int, rank: int) -> torch.Tensor:
    """Indices of the weight rows (column) / columns (row) that megatron-core gives ``rank``."""
    return torch.cat(torch.arange(size).split(size // tp // stride)[rank::tp])


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() / max(1.0, b.double().abs().max().item())


def _run_case(tp: int, config, group, case: tuple, backend: str = "auto", compute_slices: int = 0) -> dict:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_ext.layers.linear import FlashOverlapColumnParallelLinear, FlashOverlapRowParallelLinear

    kind, mode, bias, extra = case
    rank, n = group.rank(), tp
    stride, skip = extra.get("stride", 1), extra.get("skip_bias_add", False)
    size_in, size_out = (COL_IN, COL_OUT) if kind == "column" else (ROW_IN, ROW_OUT)
    common = dict(
        config=config,
        init_method=partial(torch.nn.init.normal_, std=0.3),
        bias=bias,
        stride=stride,
        skip_bias_add=skip,
        tp_comm_buffer_name="fc1" if kind == "column" else "fc2",
    )
    if kind == "column":
        common["gather_output"] = extra.get("gather_output", False)
        ours_cls, ref_cls = FlashOverlapColumnParallelLinear, ColumnParallelLinear
    else:
        common["input_is_parallel"] = True
        ours_cls, ref_cls = FlashOverlapRowParallelLinear, RowParallelLinear
    if compute_slices:  # as the spec configures it: a subclass with the config's default
        ours_cls = type(ours_cls.__name__, (ours_cls,), {"p2p_compute_slices": compute_slices})
    torch.manual_seed(1234)
    ours = ours_cls(
        size_in, size_out, keep_master_weight_for_test=True, p2p_mode=mode, backend=backend, **common
    )
    torch.manual_seed(1234)
    ref = ref_cls(size_in, size_out, **common)
    result = {
        "backend": "p2p" if ours.fused is None else "symm_mem",
        "weights_equal": torch.equal(ours.weight, ref.weight),
        "attrs_equal": all(
            getattr(p, a, None) == getattr(q, a, None)
            for p, q in zip(ours.parameters(), ref.parameters())
            for a in ATTRS
        ),
    }

    s = S_LOCAL * n
    seq = slice(rank * S_LOCAL, (rank + 1) * S_LOCAL)
    w = ours.master_weight.double()
    x_full, g_full, b_full = (
        _randn(s, BATCH, size_in, seed=1),
        _randn(s, BATCH, size_out, seed=2),
        _randn(size_out, seed=3),
    )
    idx = _partition(size_out if kind == "column" else size_in, n, stride, rank)
    if bias:
        for layer in (ours, ref):
            with torch.no_grad():
                layer.bias.copy_(b_full[idx] if kind == "column" else b_full)

    # Dense single-process reference in float64 with the master weight.
    x_dense = x_full.clone().requires_grad_()
    w_dense = w.clone().requires_grad_()
    b_dense = b_full.clone().requires_grad_()
    y_dense = x_dense @ w_dense.t() + b_dense * float(bias)
    (y_dense * g_full).sum().backward()

    if kind == "column":
        x_local = x_full[seq]
        if common["gather_output"]:
            out_cols = torch.cat([_partition(size_out, n, stride, j) for j in range(n)])
            want_y, g_local = y_dense[..., out_cols], g_full[..., out_cols]
        else:
            want_y, g_local = y_dense[..., idx], g_full[..., idx]
        want = {"x": x_dense.grad[seq], "w": w_dense.grad[idx], "b": b_dense.grad[idx]}
    else:
        x_local = x_full[..., idx]
        want_y, g_local = y_dense[seq], g_full[seq]
        want = {"x": x_dense.grad[..., idx], "w": w_dense.grad[:, idx], "b": g_local.sum((0, 1))}

    outputs, grads = {}, {}
    for name, layer in (("ours", ours), ("ref", ref)):
        x = x_local.float().clone().requires_grad_()
        y, returned_bias = layer(x)
        assert (returned_bias is not None) == (skip and bias)
        if returned_bias is not None:
            y = y + returned_bias
        (y * g_local.float()).sum().backward()
        outputs[name] = y.detach()
        grads[name] = {"x": x.grad, "w": layer.weight.grad, "b": layer.bias.grad if bias else None}
    result["out_vs_dense"] = _max_err(outputs["ours"], want_y)
    result["out_vs_ref"] = _max_err(outputs["ours"], outputs["ref"])
    for key in ("x", "w", "b"):
        if grads["ours"][key] is not None:
            result[f"grad_{key}_vs_dense"] = _max_err(grads["ours"][key], want[key])
            result[f"grad_{key}_vs_ref"] = _max_err(grads["ours"][key], grads["ref"][key])
    return result


def _all_cases(tp: int, compute_slices: int = 0) -> list[dict]:
    config, group = setup_tp(tp)
    return [_run_case(tp, config, group, case, compute_slices=compute_slices) for case in CASES]


def _symm_mem_cases(tp: int) -> list[dict]:
    """Every case with flash_overlap.backend=symm_mem, as on a platform where torch's ops run, with
    torch's reference implementations of the fused ops in their place (gloo has no symmetric memory)."""
    from unittest import mock

    from megatron_ext.layers import backend as backends
    from megatron_ext.layers import symm_mem

    config, group = setup_tp(tp)
    with (
        mock.patch.object(backends, "group_problem", return_value=None),
        mock.patch.object(symm_mem, "torch_fused_ops", symm_mem.torch_reference_ops),
    ):
        return [_run_case(tp, config, group, case, backend="symm_mem") for case in CASES]


@pytest.fixture(
    scope="module",
    params=[(2, "auto", 0), (4, "auto", 0), (4, "auto", 2), (4, "auto", 3), (2, "symm_mem", 0)],
    ids=["tp2", "tp4", "tp4-2-gemms", "tp4-3-gemms", "tp2-symm_mem"],
)
def case_results(request, run_ranks):
    tp, backend, compute_slices = request.param
    if backend == "auto":
        return tp, backend, run_ranks(tp, _all_cases, tp, compute_slices, timeout=120)
    return tp, backend, run_ranks(tp, _symm_mem_cases, tp, timeout=120)


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_matches_dense_and_megatron_core(case_results, case):
    tp, backend, per_rank = case_results
    for rank, results in enumerate(per_rank):
        result = dict(results[CASES.index(case)])  # a copy: the module's results stay whole
        # auto picks our P2P schedule on gloo (no symmetric memory)
        assert result.pop("backend") == ("p2p" if backend == "auto" else "symm_mem")
        assert result.pop("weights_equal"), (
            f"TP={tp} rank {rank}: weights differ from megatron-core's for the same seed"
        )
        assert result.pop("attrs_equal"), (
            f"TP={tp} rank {rank}: parameter attributes differ from megatron-core's"
        )
        grads = ("x", "w", "b") if case[2] else ("x", "w")  # bias: its gradient too
        compared = {
            f"{what}_vs_{ref}" for what in ("out", *(f"grad_{g}" for g in grads)) for ref in ("dense", "ref")
        }
        assert set(result) == compared, f"TP={tp} rank {rank}: compared {sorted(result)}"
        bad = {k: v for k, v in result.items() if v > 1e-5}
        assert not bad, f"TP={tp} rank {rank}: {bad}"


def _train_gpt(tp: int, steps: int) -> dict[str, list[float]]:
    from megatron.core import parallel_state as ps

    from megatron_ext.integration.gpt import gpt_loss, local_layer_spec, padded_vocab_size
    from megatron_ext.layers.sequence_parallel import allreduce_sequence_parallel_grads
    from megatron_ext.layers.spec import get_flash_overlap_layer_spec

    setup_tp(tp)
    seq, vocab = 12, padded_vocab_size(100, tp)
    tokens = torch.randint(0, 100, (steps, 2, seq + 1), generator=torch.Generator().manual_seed(7))
    specs = {
        "megatron": local_layer_spec(),
        **{mode: get_flash_overlap_layer_spec(FlashOverlapConfig(enabled=True, mode=mode)) for mode in MODES},
    }
    losses: dict[str, list[float]] = {}
    for name, spec in specs.items():
        model = seeded_gpt(
            5,
            hidden=24,
            vocab=vocab,
            seq=seq,
            tp=tp,
            sequence_parallel=True,
            ffn=40,
            layer_spec=copy.deepcopy(spec),
        )
        allreduce_sequence_parallel_grads(model, ps.get_tensor_model_parallel_group())
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        losses[name] = []
        for step in range(steps):
            batch = {
                "tokens": tokens[step, :, :-1],
                "labels": tokens[step, :, 1:],
                "loss_mask": torch.ones(2, seq),
                "position_ids": torch.arange(seq).expand(2, seq),
            }
            optimizer.zero_grad()
            loss = gpt_loss(model, batch)
            loss.backward()
            optimizer.step()
            losses[name].append(loss.item())
    return losses


@pytest.mark.slow
def test_gpt_trains_to_the_same_losses_as_megatron_core(run_ranks):
    per_rank = run_ranks(2, _train_gpt, 2, 20, timeout=120)
    # Our reduce-scatter adds the ranks' partial products with this rank's own slice last, the ring in
    # another order: fp32 differences of a few ulps per step, carried by Adam over 20 steps.
    for losses in per_rank:
        for mode in MODES:
            assert losses[mode] == pytest.approx(losses["megatron"], rel=2e-5, abs=2e-5), mode
    assert per_rank[0]["megatron"][-1] < per_rank[0]["megatron"][0] - 0.3  # it does learn


def _bad_inputs() -> dict[str, str]:
    from megatron_ext.layers.backend import BackendUnavailableError
    from megatron_ext.layers.linear import FlashOverlapColumnParallelLinear, FlashOverlapRowParallelLinear

    config, _ = setup_tp(2)
    init = partial(torch.nn.init.normal_, std=0.1)
    row = FlashOverlapRowParallelLinear(
        8,
        6,
        config=config,
        init_method=init,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
        tp_comm_buffer_name="proj",
    )
    col = FlashOverlapColumnParallelLinear(6, 8, config=config, init_method=init, tp_comm_buffer_name="qkv")
    attempts = {
        "seq": lambda: row(torch.randn(5, 2, 4)),
        "dtype": lambda: col(torch.randn(3, 2, 6, dtype=torch.float64)),
        "device": lambda: col(torch.randn(3, 2, 6, device="meta")),
        "shape": lambda: col(torch.randn(3, 2, 7)),
        "no_sp": lambda: FlashOverlapColumnParallelLinear(
            6, 8, config=dataclasses.replace(config, sequence_parallel=False), init_method=init
        ),
        "expert": lambda: FlashOverlapColumnParallelLinear(
            6, 8, config=config, init_method=init, is_expert=True
        ),
        "mode": lambda: FlashOverlapColumnParallelLinear(
            6, 8, config=config, init_method=init, p2p_mode="star"
        ),
        "backend": lambda: FlashOverlapColumnParallelLinear(
            6, 8, config=config, init_method=init, backend="symm_mem"
        ),
    }
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            messages[name] = "no error"
        except (ValueError, TypeError, BackendUnavailableError) as e:
            messages[name] = f"{type(e).__name__}: {e}"
    return messages


def test_bad_inputs_and_options_give_clear_errors(run_ranks):
    messages = run_ranks(2, _bad_inputs)[0]
    assert "sequence length 5 is not divisible by the tensor-parallel size 2" in messages["seq"]
    assert (
        messages["dtype"].startswith("TypeError")
        and "float64" in messages["dtype"]
        and "'qkv'" in messages["dtype"]
    )
    assert "meta" in messages["device"]
    assert "[s, b, 6]" in messages["shape"]
    assert "sequence_parallel=True" in messages["no_sp"]
    assert "is_expert=True" in messages["expert"]
    assert "'star'" in messages["mode"]
    assert (
        messages["backend"].startswith("BackendUnavailableError") and "gloo, not NCCL" in messages["backend"]
    )
    assert (
        "flash_overlap.backend=p2p" in messages["backend"]
        and "--flash-overlap-backend p2p" in messages["backend"]
    )


def _backend_log_lines() -> list[str]:
    import logging
    from unittest import mock

    from megatron_ext.layers import backend as backends
    from megatron_ext.layers.linear import FlashOverlapColumnParallelLinear, FlashOverlapRowParallelLinear

    config, _ = setup_tp(2)
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger(backends.__name__)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with mock.patch.object(backends, "_logged", set()):
            for _ in range(2):
                FlashOverlapColumnParallelLinear(
                    6, 8, config=config, init_method=torch.nn.init.zeros_, backend="auto"
                )
                FlashOverlapRowParallelLinear(
                    8,
                    6,
                    config=config,
                    init_method=torch.nn.init.zeros_,
                    bias=False,
                    input_is_parallel=True,
                    skip_bias_add=False,
                    backend="auto",
                )
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return lines


def test_auto_backend_picks_p2p_without_symmetric_memory_and_says_why_once(run_ranks):
    for lines in run_ranks(2, _backend_log_lines):
        assert lines == [
            "Flash-Overlap backend: p2p (flash_overlap.backend=auto: the tensor-parallel group's "
            "backend is gloo, not NCCL)"
        ]


def test_symm_mem_needs_cuda_and_is_moot_at_tensor_parallel_size_1():
    from megatron_ext.layers.backend import platform_problem, resolve_backend

    assert "the layers run on cpu, not CUDA" in platform_problem(torch.device("cpu"))
    assert resolve_backend("symm_mem", None, torch.device("cpu")) == "p2p"
    with pytest.raises(
        ValueError, match="flash_overlap.backend='nvshmem' is unknown: use one of auto, p2p, symm_mem"
    ):
        resolve_backend("nvshmem", None, torch.device("cpu"))


def _silent_peer(timed_out: str) -> None:
    """Rank 0 runs the layer, rank 1 never enters it: it stays alive and silent (a peer that leaves
    would close the link) until rank 0 has raised, which rank 0 marks by creating ``timed_out``."""
    config, _ = setup_tp(2)
    import torch.distributed as dist

    from megatron_ext.layers.linear import FlashOverlapColumnParallelLinear

    layer = FlashOverlapColumnParallelLinear(
        6, 8, config=config, init_method=torch.nn.init.zeros_, tp_comm_buffer_name="fc1", timeout_s=1.0
    )
    if dist.get_rank() == 0:
        try:
            layer(torch.randn(3, 2, 6))
        finally:
            open(timed_out, "w").close()
    else:
        from tests.helpers.waits import wait_for

        wait_for(lambda: os.path.exists(timed_out), "rank 0's error in the layer", timeout_s=60)


def test_a_silent_peer_raises_a_timeout_naming_peer_and_layer(own_ranks, tmp_path):
    # Ranks of the test's own: the timeout leaves their gloo pair closed, the shared pool stays usable.
    with pytest.raises(RankError) as info:
        own_ranks(2, _silent_peer, str(tmp_path / "timed-out"), timeout=120)
    message = str(info.value)
    assert "PeerTimeoutError" in message and "layer 'fc1'" in message and "tensor-parallel rank 1" in message


def test_single_rank_layers_need_no_process_group():
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_ext.layers.linear import FlashOverlapColumnParallelLinear, FlashOverlapRowParallelLinear

    config = ModelParallelConfig(use_cpu_initialization=True, params_dtype=torch.float32)
    init = partial(torch.nn.init.normal_, std=0.2)
    x = torch.randn(7, 3, 10)
    for ours_cls, ref_cls, extra in (
        (FlashOverlapColumnParallelLinear, ColumnParallelLinear, {}),
        (
            FlashOverlapRowParallelLinear,
            RowParallelLinear,
            {"bias": True, "input_is_parallel": True, "skip_bias_add": False},
        ),
    ):
        torch.manual_seed(0)
        ours = ours_cls(10, 9, config=config, init_method=init, **extra)
        torch.manual_seed(0)
        ref = ref_cls(10, 9, config=config, init_method=init, **extra)
        assert torch.equal(ours.weight, ref.weight)
        # megatron-core's own forward needs a process group even at TP=1; compare with the plain GEMM.
        torch.testing.assert_close(ours(x)[0], torch.nn.functional.linear(x, ref.weight, ref.bias))


def test_spec_replaces_the_chosen_linears_and_passes_mode_timeout_backend_and_topology():
    from mdsp_base.topology import Topology
    from megatron_ext.integration.gpt import local_layer_spec
    from megatron_ext.layers.linear import FlashOverlapColumnParallelLinear, FlashOverlapRowParallelLinear
    from megatron_ext.layers.spec import get_flash_overlap_layer_spec

    topology = Topology(world_size=16, ranks_per_node=8, ranks_per_package=2)
    spec = get_flash_overlap_layer_spec(
        FlashOverlapConfig(enabled=True, layers=["qkv", "fc2"], mode="ring", timeout_s=7, backend="auto"),
        topology=topology,
    )
    attn, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
    assert issubclass(attn.linear_qkv, FlashOverlapColumnParallelLinear)
    assert issubclass(mlp.linear_fc2, FlashOverlapRowParallelLinear)
    qkv = attn.linear_qkv
    assert (qkv.p2p_mode, qkv.p2p_timeout_s, qkv.overlap_backend, qkv.overlap_topology) == (
        "ring",
        7,
        "auto",
        topology,
    )
    base = local_layer_spec()
    assert attn.linear_proj is base.submodules.self_attention.submodules.linear_proj
    assert mlp.linear_fc1 is base.submodules.mlp.submodules.linear_fc1
    disabled = get_flash_overlap_layer_spec(FlashOverlapConfig(enabled=False))
    assert disabled.submodules.mlp.submodules.linear_fc2 is base.submodules.mlp.submodules.linear_fc2
