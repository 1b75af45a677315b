"""``python -m deepspeed_ext.zero.plan``: the plans a user can paste. Exact plans on paths that have
run on the topology's backend by default; one row per distinct configuration; the user's whole
DeepSpeed JSON written back with the global batch kept; a memory headroom and the model build
counted; profiles that do not fit named, unreadable ones one error line. Pure arithmetic, no ranks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from deepspeed_ext.zero.config import HierarchicalZeroConfig, InterNodeAlgorithm
from deepspeed_ext.zero.cost.collectives import Algorithm, Operation
from deepspeed_ext.zero.cost.profile import Profile, Timing, library_versions
from deepspeed_ext.zero.cost.projection import Candidate, Scheme
from deepspeed_ext.zero.cost.search import Rules, build_bytes, fitting
from deepspeed_ext.zero.cost.verified import RUN, Backend
from deepspeed_ext.zero.cost.verified import Path as VerifiedPath
from deepspeed_ext.zero.cost.workload import Model
from deepspeed_ext.zero.tools import recommend as plan_cli
from mdsp_base.topology import LinkClass

ROOT = Path(__file__).resolve().parents[4]
FRONTIER_20B = ["--model", "gpt-20b-frontier", "--nodes", "48", "--topology", "frontier"]
H100_1B = ["--model", "gpt-1.3b", "--nodes", "4", "--topology", "h100"]
H100_1B += ["--ds-config", str(plan_cli.PRESETS / "ds_nvidia_bf16.json")]


def _ds_preset() -> dict:
    return json.loads((plan_cli.PRESETS / "ds_frontier_20b.json").read_text())


def _profile(tmp_path: Path, world: int, ranks_per_node: int, ranks_per_package: int) -> Path:
    """A gloo probe profile with one inter-node ring all-gather (the line 1 ms + bus bytes at 0.5 GB/s)."""
    timings = tuple(
        Timing(
            LinkClass.INTER_NODE,
            Operation.ALL_GATHER,
            Algorithm.RING,
            world // ranks_per_node,
            1,
            n,
            (s,) * 3,
        )
        for n, s in ((1_000_000, 2e-3), (4_000_000, 5e-3))
    )
    topology = {"world_size": world, "ranks_per_node": ranks_per_node, "ranks_per_package": ranks_per_package}
    path = tmp_path / "profile.json"
    Profile(library_versions(), topology, timings).save(path)
    return path


def test_default_plans_are_exact_and_use_only_settings_run_on_the_backend(capsys):
    for argv in (FRONTIER_20B, H100_1B):
        rows = plan_cli.main([*argv, "--grad-accum", "4", "--top", "0"])
        assert rows, argv
        for row in rows:
            p = row.plan
            assert not (p.quantized_weights or p.quantized_gradients), row
            assert p.pipeline_chunks == 1 and p.inter_node == InterNodeAlgorithm.RING and not p.boundary_sync
            assert row.unverified == ()
    assert "(lossy)" not in capsys.readouterr().out


def test_lossy_and_unverified_plans_only_when_asked_and_marked(capsys):
    rows = plan_cli.main(
        [*FRONTIER_20B, "--grad-accum", "4", "--top", "0", "--allow-lossy", "--allow-unverified"]
    )
    out = capsys.readouterr().out
    assert any(r.plan.quantized_weights for r in rows) and "(lossy)" in out
    chunked = [r for r in rows if r.plan.pipeline_chunks > 1]
    assert chunked and all("pipeline_chunks 4" in r.unverified for r in chunked)
    assert any("recursive (not run on rccl)" in r.unverified for r in rows)
    assert "Lossy plans included. Paths not run on rccl included" in out


def test_one_row_per_distinct_configuration_and_no_auto():
    rows = plan_cli.main(
        [*FRONTIER_20B, "--grad-accum", "4", "--allow-lossy", "--allow-unverified", "--top", "0"]
    )
    plans = [r.plan for r in rows]
    assert len(set(plans)) == len(plans)
    assert all(p.inter_node != InterNodeAlgorithm.AUTO for p in plans)
    # Quantized hops run whole: their pipelined twins would repeat them.
    assert not [p for p in plans if p.quantized_weights and p.pipeline_chunks > 1]


@pytest.mark.parametrize(("grad_accum", "batch"), [(1, 96), (4, 384)])
def test_the_global_batch_of_the_preset_is_kept(grad_accum, batch):
    """The 20B preset: micro-batch 1 at TP 4 on 48 x 8 GCDs is DP 96, so 96 sequences per
    micro-batch step, times the accumulation."""
    for row in plan_cli.main([*FRONTIER_20B, "--grad-accum", str(grad_accum), "--top", "0"]):
        p = row.plan
        assert p.micro_batch * p.grad_accum * (48 * 8 // p.tp) == batch, row


def test_free_batch_lets_the_micro_batch_grow():
    rows = plan_cli.main([*FRONTIER_20B, "--free-batch", "--top", "0"])
    assert max(r.plan.micro_batch * (48 * 8 // r.plan.tp) for r in rows) > 96


def test_memory_keeps_the_headroom_and_counts_the_partitioned_build():
    for headroom in (0.1, 0.3):
        rows = plan_cli.main([*FRONTIER_20B, "--free-batch", "--headroom", str(headroom), "--top", "0"])
        for row in rows:
            assert row.peak_bytes <= 64e9 * (1 - headroom)
    # The 20B model whole is 41.1 GB in bf16 per rank at TP=1: built partitioned, no rank holds it.
    system, model = (
        plan_cli.TOPOLOGIES["frontier"][0],
        Model.from_megatron_args(plan_cli.MODELS["gpt-20b-frontier"]),
    )
    plan = Candidate(Scheme.OURS, tp=1)
    rules = Rules(Backend.RCCL, headroom=0.4)
    found = fitting(system, model, 48, plan, rules)
    assert found is not None and found[2] < 2 * 20_554_555_392
    # the build's peak: the model's bf16 share of 384 ranks and two of its largest module whole
    # (the word embeddings, vocab x h, larger than fc1's 4 h^2 here)
    largest = model.vocab * model.hidden
    assert largest > 4 * model.hidden**2
    assert build_bytes(model, plan, 384, rules) == 2 * (model.params / 384 + 2 * largest)


def test_the_written_json_is_the_users_config_with_the_plans_changes(tmp_path, capsys):
    out = tmp_path / "ds.json"
    rows = plan_cli.main([*FRONTIER_20B, "--output-json", str(out), "--top", "1"])
    written, given, best = json.loads(out.read_text()), _ds_preset(), rows[0].plan
    for key in ("optimizer", "bf16", "shm_data_loader", "flash_overlap", "topology", "gradient_clipping"):
        assert written[key] == given[key], key
    assert written["train_micro_batch_size_per_gpu"] == best.micro_batch
    assert written["zero_optimization"]["stage3_prefetch_bucket_size"] == best.buckets.prefetch
    assert written["zero_optimization"]["overlap_comm"] is True  # the user's own ZeRO keys stay
    section = HierarchicalZeroConfig.model_validate(written["hierarchical_zero"])  # the plugin accepts it
    assert section.inter_node_algorithm == best.inter_node and section.pipeline_chunks == best.pipeline_chunks
    assert section.secondary_level.value == best.secondary.value and section.profile is None
    text = capsys.readouterr().out
    assert f"--tensor-model-parallel-size {best.tp}" in text and "--global-batch-size 96" in text


def test_a_profile_of_the_planned_cluster_is_named_in_the_json_and_verifies_its_algorithm(tmp_path):
    profile = _profile(tmp_path, world=16, ranks_per_node=8, ranks_per_package=2)  # gloo, 2 x 8
    out = tmp_path / "ds.json"
    argv = ["--layers", "4", "--hidden", "1024", "--heads", "16", "--seq", "1024", "--nodes", "2"]
    rows = plan_cli.main([*argv, "--profile", str(profile), "--output-json", str(out), "--top", "0"])
    assert json.loads(out.read_text())["hierarchical_zero"]["profile"] == str(profile)
    # On Frontier the point-to-point steps have never run, and gloo's run verifies nothing on RCCL.
    assert all(r.plan.inter_node == InterNodeAlgorithm.RING for r in rows)


def test_a_profile_of_another_topology_is_used_with_every_difference_named(tmp_path, capsys):
    profile = _profile(tmp_path, world=8, ranks_per_node=2, ranks_per_package=2)  # the emulated cluster's
    out = tmp_path / "ds.json"
    plan_cli.main([*FRONTIER_20B, "--profile", str(profile), "--output-json", str(out), "--top", "1"])
    err = capsys.readouterr().err
    assert "measured on gloo, the plan runs on rccl" in err
    assert "measured on 8 ranks, 2 per node and 2 per package, the plan is for 384, 8 and 2" in err
    assert "holds no timings for package, node" in err and "documented costs there" in err
    assert "profile" not in json.loads(out.read_text())["hierarchical_zero"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read the profile .*: No such file or directory"),
        (b"\xff\xfe not text", "not a profile \\(not UTF-8 text"),
        (b"{ broken", "is not valid JSON"),
        (b'{"format": "other"}', "is not a hierarchical ZeRO profile"),
    ],
)
def test_an_unreadable_profile_is_one_error_line_and_exit_2(tmp_path, capsys, content, message):
    path = tmp_path / "p.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SystemExit) as exit_:
        plan_cli.main([*FRONTIER_20B, "--profile", str(path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert re.search(message, err[0]), err


def test_the_cli_speaks_like_its_neighbours(capsys):
    with pytest.raises(SystemExit):
        plan_cli.main(["--help"])
    assert capsys.readouterr().out.startswith("usage: python -m deepspeed_ext.zero.plan")
    plan_cli.main([*H100_1B, "--top", "1"])
    out = capsys.readouterr()
    assert "TFLOPS/GPU" in out.out and "TFLOPS/GCD" not in out.out
    assert "COMPUTED by the cost model" in out.out and "over the uncertain inputs (6 combinations)" in out.out
    assert "projecting candidates" in out.err  # progress goes to stderr, the table to stdout
    with pytest.raises(SystemExit, match="2"):
        plan_cli.main(["--layers", "4", "--nodes", "2"])
    assert "--layers --hidden --heads --seq" in capsys.readouterr().err


def test_model_names_are_the_slurm_scripts_presets_shipped_in_the_package():
    assert plan_cli.PRESETS.resolve().is_relative_to((ROOT / "mdsp_base").resolve())
    slurm_defaults = {"gpt-20b-frontier", "gpt-1.3b", "tiny-cpu"}
    assert slurm_defaults <= set(plan_cli.MODELS)
    for name in slurm_defaults:
        assert f"DEFAULT_MODEL={name}" in "".join(
            p.read_text() for p in (ROOT / "scripts" / "slurm").glob("*.sbatch")
        )


def markdown_table() -> str:
    """The docs' table of :data:`RUN`."""
    lines = ["| path | gloo (CPU) | NCCL (CUDA) | RCCL (ROCm) |", "|---|---|---|---|"]
    lines += [f"| {path.value} | {' | '.join(RUN[path][b] for b in Backend)} |" for path in VerifiedPath]
    return "\n".join(lines)


def test_the_docs_backend_table_is_the_planners_source():
    assert markdown_table() in (ROOT / "docs" / "hierarchical_zero.md").read_text()


def test_where_no_byte_crosses_a_nic_the_planner_keeps_stock_zero3(tmp_path, capsys):
    # one node: the best plan projects what stock ZeRO-3 does at its TP, so it is not recommended
    out = tmp_path / "ds.json"
    rows = plan_cli.main(
        ["--model", "gpt-1.3b", "--nodes", "1", "--topology", "h100", "--output-json", str(out)]
    )
    assert rows[0].ratios["zero3"] < plan_cli.NO_GAIN
    assert "No gain: the best plan projects 1.00x stock ZeRO-3's TFLOPS" in capsys.readouterr().out
    written = json.loads(out.read_text())
    assert written["hierarchical_zero"]["enabled"] is False and written["zero_optimization"]["stage"] == 3
    # across nodes it is recommended
    rows = plan_cli.main([*FRONTIER_20B, "--output-json", str(out), "--top", "1"])
    assert (
        rows[0].ratios["zero3"] >= plan_cli.NO_GAIN
        and json.loads(out.read_text())["hierarchical_zero"]["enabled"]
    )
