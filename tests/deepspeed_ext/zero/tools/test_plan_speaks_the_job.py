"""The planner speaks the job: its Megatron flags parse in scripts/pretrain_gpt.py and in the
upstream parsers, its input JSON is refused as the job refuses it, every number is range-checked
with one error line, its range line names the input that dominates, each word of a candidate's
label is explained, and what it says has run is verified.py's table."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from dataclasses import replace
from pathlib import Path

import pytest

from deepspeed_ext.zero.cost.workload import Model, Recompute
from deepspeed_ext.zero.tools import recommend as plan_cli
from megatron_ext.integration.plugin_config import load_plugin_config
from megatron_ext.trainer.cli import parse_args

DATA = Path(__file__).resolve().parents[3] / "data"
H100_20B = ["--model", "gpt-20b-frontier", "--nodes", "2", "--topology", "h100"]
H100_20B += ["--ds-config", str(plan_cli.PRESETS / "ds_nvidia_bf16.json")]
# Megatron's own values for the recompute flags (megatron/training/arguments.py, both trees).
UPSTREAM_CHOICES = {
    "--recompute-granularity": {"full", "selective"},
    "--recompute-method": {"uniform", "block"},
}


def _upstream_parser(name: str) -> argparse.ArgumentParser:
    """Every option string the upstream parser has (recorded in tests/data), with Megatron's choices."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    for line in (DATA / name).read_text().splitlines():
        if line.startswith("--"):
            parser.add_argument(
                line, choices=UPSTREAM_CHOICES.get(line), nargs=None if line in UPSTREAM_CHOICES else "*"
            )
    return parser


def _flags_of_every_row(capsys) -> list[list[str]]:
    """The flags of every row the planner proposes, each also with every recompute setting (the
    rows may not cover them all)."""
    rows = plan_cli.main([*H100_20B, "--free-batch", "--top", "0"])
    capsys.readouterr()
    model = Model.from_megatron_args(plan_cli.MODELS["gpt-20b-frontier"])
    variants = [replace(r, plan=replace(r.plan, recompute=c)) for r in rows for c in Recompute]
    return [shlex.split(" ".join(plan_cli.megatron_flags(r, model, 64))) for r in rows + variants]


def test_every_rows_flags_parse_in_the_job_and_upstream(capsys):
    megatron_lm = _upstream_parser("megatron_lm_flags.txt")
    megatron_ds = _upstream_parser("megatron_deepspeed_flags.txt")
    for flags in _flags_of_every_row(capsys):
        job = parse_args(flags)  # argparse exits 2 on a flag the job lacks
        assert job.num_layers == 44 and job.seq_length == 2048
        if "full" in flags:
            assert (job.recompute_method, job.recompute_num_layers) == ("uniform", 1)
        for upstream in (megatron_lm, megatron_ds):
            upstream.parse_args(flags)


def test_the_job_trains_with_the_planners_recompute_flags_exactly_as_without(pretrain_main, tmp_path):
    losses = {}
    for name, extra in (
        ("off", []),
        ("selective", ["--recompute-granularity", "selective"]),
        (
            "full",
            [
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "1",
            ],
        ),
    ):
        log = tmp_path / f"{name}.jsonl"
        assert pretrain_main("--train-iters", "3", "--log-json", str(log), *extra) == 0
        losses[name] = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    assert losses["selective"] == losses["off"] == losses["full"] and len(losses["off"]) == 3


@pytest.mark.parametrize(
    ("ds", "message"),
    [
        (
            {"zero_optimization": {"stage": 3}, "shm_data_loader": {"slotz": 4}},
            "unknown key 'shm_data_loader.slotz'",
        ),
        (
            {"zero_optimization": {"stage": 1}, "hierarchical_zero": {"enabled": True}},
            "hierarchical_zero.enabled=true needs zero_optimization.stage 3, got stage 1",
        ),
        ({"zero_optimization": {"stage": 3, "overlap_comms": True}}, "did you mean 'overlap_comm'?"),
    ],
)
def test_an_input_json_the_job_refuses_is_refused_and_nothing_written(tmp_path, capsys, ds, message):
    path, out = tmp_path / "ds.json", tmp_path / "out.json"
    path.write_text(json.dumps(ds))
    with pytest.raises(SystemExit) as stop:
        plan_cli.main(
            [*H100_20B[:6], "--ds-config", str(path), "--output-json", str(out)],
            check_sections=load_plugin_config,
        )
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error:") and message in err and err.count("\n") == 1
    assert not out.exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nodes", "0"], "--nodes 0: give a positive number"),
        (["--nodes", "-3"], "--nodes -3: give a positive number"),
        (["--nodes", "2", "--memory-gb", "0"], "--memory-gb 0.0: give a positive number"),
        (["--nodes", "2", "--grad-accum", "0"], "--grad-accum 0: give a positive number"),
        (["--nodes", "2", "--global-batch", "0"], "--global-batch 0: give a positive number"),
        (["--nodes", "2", "--top", "-1"], "--top -1: give 0 or more"),
        (["--nodes", "2", "--headroom", "1"], "--headroom 1.0: give a fraction in [0, 1)"),
    ],
)
def test_every_number_is_range_checked_in_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        plan_cli.main(["--model", "gpt-20b-frontier", *argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err == f"error: {message}\n"


def test_a_shape_flag_out_of_range_too(capsys):
    for argv, message in (
        (
            ["--layers", "0", "--hidden", "64", "--heads", "4", "--seq", "8"],
            "--layers 0: give a positive number",
        ),
        (
            ["--layers", "2", "--hidden", "65", "--heads", "4", "--seq", "8"],
            "--hidden 65 is not divisible by --heads 4",
        ),
    ):
        with pytest.raises(SystemExit):
            plan_cli.main([*argv, "--nodes", "2"])
        assert capsys.readouterr().err == f"error: {message}\n"


def test_the_range_line_names_the_dominant_input_and_the_label_only_explained_words(capsys):
    plan_cli.main(["--model", "gpt-20b-frontier", "--nodes", "48", "--top", "3"])
    out = capsys.readouterr().out
    # At 48 Frontier nodes the gradient and weight traffic across nodes is a large share of the
    # step: whether it hides behind compute (overlap 0 to 0.9) moves the step most, more than the
    # GEMMs' efficiency or the ring's constants.
    assert re.search(r"most of the spread is overlap \(0-0\.9 moves it [\d.]+ TFLOPS/GCD on average\)", out)
    legend = next(line for line in out.splitlines() if line.startswith("candidate: "))
    labels = [line.split(" | ")[1] for line in out.splitlines() if line.startswith("| best |")]
    explained = {key for keys in re.findall(r"([\w-]+(?:, [\w-]+)*) = ", legend) for key in keys.split(", ")}
    for word in labels[0].split():
        key, _, value = word.partition("=")
        assert value and key in explained, f"{word!r} is not explained by: {legend}"


def test_what_has_run_is_verified_pys_words(capsys):
    """docs/hierarchical_zero.md's table says every path is "never" on RCCL: so does the plan."""
    plan_cli.main(["--model", "gpt-20b-frontier", "--nodes", "48", "--top", "1"])
    out = capsys.readouterr().out
    assert "run on rccl: never; no other path has run there." in out
    assert "Only settings that have run" not in out
    doc = (Path(__file__).resolve().parents[4] / "docs" / "hierarchical_zero.md").read_text()
    assert (
        "| hops as library collectives, one level after another (the default) | tests, emulated cluster |"
        in doc
    )
