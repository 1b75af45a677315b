"""The Flash-Overlap benchmark's baselines are what they claim: the 4-chunk slicing computes exactly what
megatron-core's linears compute, forward and backward, in the MLP and in a whole layer; and the
compute-only twin holds exactly one rank's weight shapes, so T_comp is that rank's work; on the
compute stand-in both commands write the device and their paired comparisons."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.flash_overlap.paired import compare, verdict
from benchmarks.flash_overlap.run import REPO_ROOT as REPO
from benchmarks.flash_overlap.run import derived_dilation
from benchmarks.flash_overlap.run import main as run_main
from benchmarks.flash_overlap.targets import TP_BASELINES, paired_across, targets
from mdsp_base.paired import MIN_PAIRS


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
        twin = Block(block, "compute_only", shapes, tp, 2)
        out[block]["same_shapes"] = shard_shapes == [tuple(p.shape) for p in twin.parameters()]
        if rank == 0:  # the twin steps on one rank alone: any transfer of its own would never complete
            y = twin.step(x.chunk(2)[rank].contiguous(), grad.chunk(2)[rank].contiguous())
            out[block]["twin_output"] = tuple(y.shape)
        dist.barrier()
    return out


def test_chunked_baseline_equals_megatron_core_and_the_compute_only_twin_is_its_kernels_alone(run_ranks):
    for rank, per_rank in enumerate(run_ranks(2, _blocks_against_megatron_core, timeout=120)):
        for block in ("mlp", "layer"):
            assert per_rank[block]["same_shapes"], block
            if rank == 0:
                assert per_rank[block]["twin_output"] == (8, 2, 32), block  # this rank's [s/N, b, h]
            assert per_rank[block]["chunked_4"] < 1e-5, (block, per_rank[block])
            assert per_rank[block]["flash_overlap"] < 1e-5, (block, per_rank[block])


# The commands on the compute stand-in: the fields their results carry, not speed. Loopback with a
# given dilation, so no root is needed and the virtual device adds little time.
STAND_IN = ("--network", "loopback", "--device", "h100", "--dilation", "1")
PAIRED_KEYS = {"case", "variant", "baseline", "metric", "ratio", "ci95"}


def _command(module: str, *args: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", module, *STAND_IN, *args],
        cwd=REPO,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _check_paired(entries: list[dict], cases: set[str]) -> None:
    assert {e["case"] for e in entries} == cases
    for e in entries:
        assert set(e) >= PAIRED_KEYS and e["metric"] in ("exposed", "step"), e
        assert e["pairs"] >= MIN_PAIRS
        low, high = e["ci95"]
        assert low <= e["ratio"] <= high, e


@pytest.mark.slow
def test_the_run_command_on_a_stand_in_h100_writes_paired_ratios(tmp_path: Path) -> None:
    sizes = ("--seq-per-rank", "16", "--hidden", "64", "--heads", "4", "--ffn", "64", "--blocks", "mlp")
    _command(
        "benchmarks.flash_overlap.run", "--tp", "2", "--out", str(tmp_path), *sizes,
        "--regimes", "balanced", "--methods", "megatron_core", "flash_overlap", "--warmup", "1",
    )  # fmt: skip
    result = json.loads((tmp_path / "loopback_tp2_h100.json").read_text())
    assert result["device"] == "h100"
    assert result["summaries"][0]["stand_in"]["device"] == "h100"
    steps = [e for e in result["paired"] if e["metric"] == "step"]
    assert [(e["variant"], e["baseline"]) for e in steps] == [("flash_overlap", "megatron_core")]
    _check_paired(steps, {"tp2-mlp-balanced"})
    assert not list(tmp_path.glob("*.png"))  # no profiled step on a stand-in: no timelines


@pytest.mark.slow
def test_the_overlap_command_on_a_stand_in_h100_writes_device_and_paired_ratios(tmp_path: Path) -> None:
    # UP only (its TP ranks are the run command's, above): one launch instead of two
    _command("benchmarks.flash_overlap.overlap", "--quick", "--tp", "--sp", "2", "--out", str(tmp_path))
    result = json.loads((tmp_path / "overlap_loopback_h100_quick.json").read_text())
    assert result["device"] == "h100" and result["dilation"] == {"sp2": 1.0}
    assert result["up"][0]["stand_in"]["device"] == "h100"
    _check_paired(result["paired"], {"sp2-ulysses"})
    formed = {(e["variant"], e["baseline"]) for e in result["paired"] if e["metric"] == "step"}
    assert ("ulysses_group_major", "distributed_attention_p2p") in formed
    for e in result["unpaired"]:  # an exposed time at or below zero: no log ratio, said why
        assert e["ratio"] is None and e["why"]
    # values are not computed on a stand-in: no agreement check
    assert all(
        m["max_abs_diff_vs_distributed_attention"] is None for m in result["up"][0]["methods"].values()
    )


def _summary(block: str, ours: float) -> dict:
    """A TP case of one launch: Flash-Overlap's step ``ours`` against 1.0 s for every baseline."""
    noise = [1.0 + 0.01 * (i % 3) for i in range(MIN_PAIRS)]
    repeats = {name: noise for name in TP_BASELINES}
    repeats |= {"flash_overlap": [ours * t for t in noise], "compute_only": [0.5] * MIN_PAIRS}
    return {"tp": 2, "block": block, "comm_over_comp": {"p2p": 1.0}, "repeats_s": repeats}


def test_tp_cases_are_named_by_degree_and_judged_on_their_paired_ratio() -> None:
    runs = [[[_summary("mlp", 0.7), _summary("layer", 1.0)]]]  # [size][launch][block]
    entries = paired_across(runs, [])
    assert {e["case"] for e in entries} == {"tp2-mlp", "tp2-layer"}
    rows = {(r["case"], r["target"]): r["result"] for r in targets(entries, runs, [])}
    # exposed: (0.7 - 0.5) / (1.0 - 0.5) = 0.4 <= 0.5 of megatron-core's, and <= 0.7 of TE's
    assert set(rows.values()) == {"met", "not separated"}
    assert all(result == "met" for (case, _), result in rows.items() if case == "tp2-mlp")


def test_the_dilation_is_the_gpu_link_over_the_emulated_one() -> None:
    assert derived_dilation("h100", 2, 400.0) == pytest.approx(450e9 * 8 / 400e6)
    assert derived_dilation("mi250x", 2, 400.0) == pytest.approx(200e9 * 8 / 400e6)
    assert derived_dilation("mi250x", 4, 400.0) == pytest.approx(50e9 * 8 / 400e6)  # spans packages


def test_a_stand_in_on_loopback_needs_a_dilation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["run", "--network", "loopback", "--device", "h100"])
    with pytest.raises(SystemExit):
        run_main()


def test_a_comparison_needs_enough_pairs_of_positive_times() -> None:
    repeats = {"a": [2.0] * MIN_PAIRS, "b": [3.0] * MIN_PAIRS, "compute_only": [2.0] * MIN_PAIRS}
    assert compare("c", repeats, "b", "a", "exposed")["why"].startswith("exposed <= 0")
    short = {name: times[:-1] for name, times in repeats.items()}
    assert compare("c", short, "b", "a", "step")["why"] == f"fewer than {MIN_PAIRS} pairs"
    repeats["b"] = [3.0, 3.3] * (MIN_PAIRS // 2)
    entry = compare("c", repeats, "b", "a", "step")
    assert entry["ci95"][0] > 1 and verdict(entry).startswith("1.5")


@pytest.mark.slow
def test_a_presets_stack_of_layers_runs_every_tp_method_with_domino_on_a_stand_in(tmp_path: Path) -> None:
    # one 1.3B layer (hidden 2048, MLP 8192) over a 64-token sequence: fields, not speed
    _command(
        "benchmarks.flash_overlap.overlap", "--quick", "--preset", "1.3b", "--layers", "1", "--seq", "64",
        "--tp", "2", "--sp", "--out", str(tmp_path),
    )  # fmt: skip
    result = json.loads((tmp_path / "overlap_loopback_h100_1.3b_tp2_quick.json").read_text())
    case = result["tp"][0]
    assert (case["block"], case["tp"], case["ffn"]) == ("layers", 2, 8192)
    assert set(case["methods"]) == {*TP_BASELINES, "flash_overlap"}
    bound = case["schedule_bound_s"]  # max(compute, communication) + one slice
    assert bound > max(case["t_comp_s"]["median"], case["t_comm_s"]["p2p"]["median"])
    charged = [m["device_per_step"] for m in case["methods"].values()] + [
        case["compute_only_device_per_step"]
    ]
    assert all(c["kernels"] > 0 and c["busy_s"] > 0 for c in charged)  # counted per method and twin
    _check_paired(result["paired"], {"tp2-layers"})
    versus_domino = [e for e in result["paired"] if e["baseline"] == "domino_p2p"]
    assert [e["metric"] for e in versus_domino] == ["step"]  # its compute is not the twin's
    assert any(r["target"].startswith("step <= 1.0x DeepSpeed Domino") for r in result["targets"])


@pytest.mark.slow
def test_merged_gemms_run_beside_the_default_with_fewer_kernels_on_a_stand_in(tmp_path: Path) -> None:
    # one 1.3B layer at TP=4, each collective's slices merged into 2 GEMMs: fields, not speed
    _command(
        "benchmarks.flash_overlap.overlap", "--quick", "--preset", "1.3b", "--layers", "1", "--seq", "64",
        "--tp", "4", "--sp", "--compute-slices", "2", "--out", str(tmp_path),
    )  # fmt: skip
    result = json.loads((tmp_path / "overlap_loopback_h100_1.3b_tp4_slices-2_quick.json").read_text())
    assert result["compute_slices"] == {"tp4": {"gemms": 2, "computed_layer_forward_s": None}}
    methods = result["tp"][0]["methods"]
    merged, finest = (
        methods[m]["device_per_step"]["kernels"] for m in ("flash_overlap_merged", "flash_overlap")
    )
    # forward and backward: 2 GEMMs instead of 4 in each of the 4 linears' fused all-gathers or reduce-scatters
    assert merged < finest, (merged, finest)
    formed = {(e["variant"], e["baseline"]) for e in result["paired"] if e["metric"] == "step"}
    assert {
        ("flash_overlap_merged", "flash_overlap"),
        ("flash_overlap_merged", "megatron_core_p2p"),
    } <= formed


def test_the_summary_states_the_schedules_gain_and_the_transports_apart(tmp_path: Path) -> None:
    from benchmarks.flash_overlap.summary import main as summary_main

    case = _summary("layers", 0.7) | {"tp": 4, "schedule_bound_s": 0.5}
    del case["repeats_s"]["domino_p2p"]  # a run without Domino: said, not guessed
    charged = {"kernels": 10, "busy_s": 0.6}
    case |= {"methods": {"flash_overlap": {"step_s": {"median": 0.7}, "device_per_step": charged}}}
    case |= {"compute_only_device_per_step": {"kernels": 8, "busy_s": 0.5}}
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"device": "mi250x", "dilation": {"tp4": 800}, "tp": [case], "up": []}))
    summary_main(["--tp", str(run), "--out", str(tmp_path / "page.md")])
    row = next(
        line for line in (tmp_path / "page.md").read_text().splitlines() if line.startswith("| tp4-layers")
    )
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "mi250x (dilation 800)"
    assert cells[3].startswith("0.40")  # exposed about (0.7 - 0.5) / (1.0 - 0.5)
    assert cells[6] == "not run"  # Domino
    assert cells[7].startswith("1.000x") and cells[7].endswith("not separated")  # the transport alone
    assert cells[8] == "1.40" and cells[9] == "10 / 8, +100.0 ms"
    assert cells[10] == "not run"  # no merged GEMMs in this run


def test_the_summary_lists_a_degree_once_per_contention_and_names_it(tmp_path: Path) -> None:
    from benchmarks.flash_overlap.summary import main as summary_main

    case = _summary("layers", 0.7) | {"tp": 4, "schedule_bound_s": 0.5}
    case |= {"methods": {"flash_overlap": {"step_s": {"median": 0.7}}}, "compute_only_device_per_step": None}
    runs = []
    for contention in (0.2, None, 0.1):  # given out of order; a case off the stand-in records none
        stand_in = None if contention is None else {"contention": contention}
        runs.append(tmp_path / f"run{len(runs)}.json")
        runs[-1].write_text(json.dumps({"device": "mi250x", "dilation": {"tp4": 800},
                                        "tp": [case | {"stand_in": stand_in}], "up": []}))  # fmt: skip
    summary_main(["--tp", *map(str, runs), "--out", str(tmp_path / "page.md")])
    devices = [
        line.split("|")[2].strip()
        for line in (tmp_path / "page.md").read_text().splitlines()
        if line.startswith("| tp4-layers")
    ]
    assert devices == [
        "mi250x (dilation 800)",
        "mi250x (dilation 800, contention 0.1)",
        "mi250x (dilation 800, contention 0.2)",
    ]
