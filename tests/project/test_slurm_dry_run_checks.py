"""Before the queue: the Slurm scripts' dry run refuses what the job would refuse at start-up, with
the job's own error line (plugin sections, DeepSpeed's sections, training flags, divisibility),
warns where a setting would silently do nothing, prints the whole submit line, and docs/slurm.md
shows its real output."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from tests.project.test_slurm_scripts import ROOT, run

DOC = ROOT / "docs" / "slurm.md"
STAGE3 = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}

# (training flags, DeepSpeed JSON or None for the preset's, what the job's error line says)
REFUSED = [
    (["--nodse", "2"], None, "error: unrecognized arguments: --nodse 2"),
    (["--num-layrs", "2"], None, "did you mean --num-layers?"),
    (
        [],
        {**STAGE3, "shm_data_loader": {"enabled": True, "slotz": 4}},
        "unknown key 'shm_data_loader.slotz'",
    ),
    (
        [],
        {"zero_optimization": {"stage": 1}, "hierarchical_zero": {"enabled": True}},
        "hierarchical_zero.enabled=true needs zero_optimization.stage 3, got stage 1",
    ),
    (
        [],
        {"zero_optimization": {"stage": 3, "overlap_comms": True}},
        "DeepSpeedZeroConfig rejects 'overlap_comms' (extra inputs are not permitted): did you mean 'overlap_comm'?",
    ),
    (
        ["--seq-length", "63"],
        None,
        "flash_overlap (it runs sequence-parallel) needs --seq-length divisible by "
        "--tensor-model-parallel-size: 63 is not a multiple of 2",
    ),
    (
        ["--seq-length", "63", "--sequence-parallel", "--no-flash-overlap"],
        None,
        "--sequence-parallel needs --seq-length divisible",
    ),
    (
        ["--num-attention-heads", "3"],
        None,
        "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2",
    ),
    (["--hidden-size", "66"], None, "--hidden-size 66 is not divisible by --num-attention-heads 4"),
    (
        ["--global-batch-size", "6"],
        {"zero_optimization": {"stage": 3}},
        "--global-batch-size 6 is not a multiple of micro batch (2) x data-parallel (2)",
    ),
    (["--micro-batch-size", "0"], None, "--micro-batch-size 0: give a positive number"),
    (
        ["--recompute-granularity", "full"],
        None,
        "--recompute-granularity full needs --recompute-method and --recompute-num-layers",
    ),
]


def _config(tmp_path: Path, ds: dict | None) -> dict[str, str]:
    if ds is None:
        return {}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return {"CONFIG": str(path)}


@pytest.mark.parametrize(
    ("flags", "ds", "needle"), REFUSED, ids=[" ".join(c[0]) or c[2][:30] for c in REFUSED]
)
def test_the_dry_run_refuses_what_the_job_refuses_with_its_line(
    pretrain_main, monkeypatch, capsys, tmp_path, flags, ds, needle
):
    """The local script (the tiny preset: TP 2, Flash-Overlap on; 4 ranks) against the job itself
    started as rank 0 of 4: the same single line, exit 2, and the dry run stops before its plan."""
    env = _config(tmp_path, ds)
    dry = run("local", "--", *flags, DRY_RUN="1", JOB_CHECKS="1", **env)
    assert dry.returncode == 2, dry.stdout + dry.stderr
    assert dry.stderr.count("\n") == 1 and dry.stderr.startswith("error:") and needle in dry.stderr
    assert "# DRY RUN" not in dry.stdout
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    preset = shlex.split((ROOT / "scripts/presets/tiny-cpu.args").read_text(), comments=True)
    config = env.get("CONFIG", str(ROOT / "scripts/presets/ds_cpu_local.json"))
    try:
        status = pretrain_main(*preset, "--deepspeed-config", config, *flags)
    except SystemExit as e:  # argparse's refusal of a flag
        status = e.code
    assert status == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == dry.stderr.strip()


def test_presets_pass_and_an_interval_without_a_checkpoint_directory_warns():
    for platform in ("frontier", "nvidia", "local"):
        proc = run(platform, DRY_RUN="1", JOB_CHECKS="1")
        assert proc.returncode == 0, proc.stderr
    frontier = run("frontier", DRY_RUN="1", JOB_CHECKS="1").stderr
    assert "warning: --save-interval 500 without --save: no checkpoint will be written" in frontier
    assert "CHECKPOINT_DIR=DIR" in frontier
    saved = run("frontier", "--checkpoint-dir", "/ckpt", DRY_RUN="1", JOB_CHECKS="1")
    assert saved.returncode == 0 and "--save-interval" not in saved.stderr


def test_upstream_and_zero_ab_dry_runs_check_the_plugin_and_deepspeed_sections(tmp_path):
    tree = tmp_path / "mds"
    (tree / "megatron").mkdir(parents=True)
    (tree / "megatron" / "training.py").touch()
    (tree / "pretrain_gpt.py").touch()
    env = _config(tmp_path, {**STAGE3, "flash_overlap": {"enabeld": True}})
    upstream = run("local", DRY_RUN="1", JOB_CHECKS="1", UPSTREAM_DIR=str(tree), DATA_PATH="corpus", **env)
    assert upstream.returncode == 2 and "unknown key 'flash_overlap.enabeld'" in upstream.stderr
    env = _config(tmp_path, {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket": 1}})
    ab = run("local", "--job", "zero-ab", DRY_RUN="1", JOB_CHECKS="1", **env)
    assert ab.returncode == 2 and "DeepSpeedZeroConfig rejects 'stage3_prefetch_bucket'" in ab.stderr


def test_job_checks_off_leaves_them_to_the_job_and_a_bad_value_is_refused():
    assert run("local", "--", "--nodse", "2", DRY_RUN="1", JOB_CHECKS="0").returncode == 0
    bad = run("local", DRY_RUN="1", JOB_CHECKS="maybe")
    assert bad.returncode == 2 and "JOB_CHECKS='maybe' is not understood" in bad.stderr


def test_the_submit_line_is_whole():
    proc = run("frontier", "--model", "gpt-1.3b", "--", "--train-iters", "10", DRY_RUN="1", NODES="2")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("# submit: "))
    # Frontier charges a project: a placeholder where ACCOUNT is unset, never nothing.
    assert (
        line
        == "# submit: sbatch -A <ACCOUNT> -N 2 scripts/slurm/frontier.sbatch --model gpt-1.3b -- --train-iters 10"
    )
    local = run("local", "--dry-run", DRY_RUN="0", PARTITION="debug").stdout
    assert "# submit: sbatch -p debug -N 1 scripts/slurm/local.sbatch\n" in local


def _doc_blocks() -> tuple[str, str, str]:
    """The command, standard output and standard error that docs/slurm.md's "Dry-run output" shows."""
    section = DOC.read_text().split("### Dry-run output", 1)[1].split("\n## ", 1)[0]
    command = re.search(r"Really produced by `([^`]+)`", section)
    blocks = re.findall(r"```text\n(.*?)```", section, re.S)
    assert command and len(blocks) == 2, "docs/slurm.md's Dry-run output lost its command or blocks"
    return command.group(1), blocks[0], blocks[1]


def test_docs_show_the_real_dry_run():
    """The doc's command, run as written (with the doc's user and home), prints the doc's blocks
    exactly; the checkout path is shown as <repo>, this host's address as 127.0.0.1."""
    command, out, err = _doc_blocks()
    words = shlex.split(command)
    env = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
    args = [w for w in words if not re.match(r"^[A-Z_]+=", w)]
    assert args[:2] == ["bash", "scripts/slurm/frontier.sbatch"], command
    proc = run("frontier", *args[2:], USER="alice", HOME="/ccs/home/alice", JOB_CHECKS="1", **env)
    real_out = re.sub(r"(?m)^export MASTER_ADDR=.*$", "export MASTER_ADDR=127.0.0.1", proc.stdout)
    assert real_out.replace(str(ROOT), "<repo>") == out, f"docs/slurm.md's dry run is stale; now:\n{real_out}"
    assert proc.stderr.replace(str(ROOT), "<repo>") == err, f"its warnings are now:\n{proc.stderr}"
    for name in (
        "NODES",
        "MODEL",
        "CONFIG",
        "DATA_PATH",
        "EXTRA_ARGS",
        "DRY_RUN",
        "CHECKPOINT_DIR",
        "JOB_CHECKS",
    ):
        assert f"`{name}`" in DOC.read_text(), f"docs/slurm.md does not document {name}"
