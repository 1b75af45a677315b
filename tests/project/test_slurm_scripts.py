"""The Slurm launchers' dry runs and parameter checks (no Slurm needed).

``DRY_RUN=1 bash scripts/slurm/<platform>.sbatch`` prints the modules, the exported environment,
the per-rank variables and the srun line; these tests hold them to what docs/slurm.md promises.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.helpers.slurm import LAUNCHER_PARAMS

ROOT = Path(__file__).resolve().parents[2]
SLURM_DIR = ROOT / "scripts" / "slurm"
PRESETS = ROOT / "scripts" / "presets"
PLATFORMS = ("frontier", "nvidia", "local")
# Cleared from the caller's environment so each dry run starts clean: the launcher's parameters, the
# platform scripts' own, and what they export.
PARAMS = LAUNCHER_PARAMS | {
    "MODULES",
    "AWS_OFI_RCCL_DIR",
    "GPUS_PER_NODE",
    "GPU_BINDING",
    "LD_LIBRARY_PATH",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "LAUNCH_LOCAL_RANK",
    "PYTHONPATH",
    "JOB",
    "AB_DIR",
    "ACCOUNT",
    "PARTITION",
    "CONTAINER_IMAGE",
    "APPTAINER_IMAGE",
    "CONTAINER_MOUNTS",
    "ROCM_VERSION",
    "CPUS_PER_TASK",
    "JOB_CHECKS",
}
# Flags the main job takes (scripts/pretrain_gpt.py's documented interface).
JOB_FLAGS = {
    "--tensor-model-parallel-size",
    "--num-layers",
    "--hidden-size",
    "--num-attention-heads",
    "--seq-length",
    "--max-position-embeddings",
    "--micro-batch-size",
    "--global-batch-size",
    "--train-iters",
    "--lr",
    "--data-path",
    "--save",
    "--load",
    "--save-interval",
    "--deepspeed-config",
    "--bf16",
    "--log-interval",
    "--shm-data-loader",
    "--hierarchical-zero",
    "--flash-overlap",
}


def clean_env(**extra: str) -> dict[str, str]:
    """The caller's environment without the launcher's settings; the job's own checks (a Python
    start-up each, tested in test_slurm_dry_run_checks.py) off unless ``extra`` turns them on."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "NCCL_", "FI_", "MIOPEN_", "GLOO_")) and k not in PARAMS
    }
    env.update({"JOB_CHECKS": "0", **extra})
    return env


def run(
    platform: str, *args: str, env: dict[str, str] | None = None, **kw: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SLURM_DIR / f"{platform}.sbatch"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
        env=env or clean_env(**kw),
    )


class Plan:
    """Parsed dry-run output."""

    def __init__(self, out: str) -> None:
        self.text = out
        self.env: dict[str, str] = {}
        self.modules: list[str] = []
        self.srun: list[str] = []
        for line in out.splitlines():
            if line.startswith("export "):
                name, _, value = line[len("export ") :].partition("=")
                self.env[name] = shlex.split(value)[0] if value else ""
            elif line.startswith("module load "):
                self.modules.append(line.split()[2])
            elif line.startswith("srun "):
                self.srun = shlex.split(line)
        assert self.srun, f"no srun line in:\n{out}"
        self.launcher = self.srun.index(str(SLURM_DIR / "rank_env.sh"))
        self.srun_flags = self.srun[1 : self.launcher]
        self.job = self.srun[self.launcher + 1 :]

    def job_flag(self, name: str) -> str:
        """Value of the last occurrence of a training flag (argparse semantics)."""
        idx = [i for i, a in enumerate(self.job) if a == name]
        assert idx, f"{name} missing from {self.job}"
        return self.job[idx[-1] + 1]


def dry(platform: str, *args: str, **env: str) -> Plan:
    res = run(platform, *args, DRY_RUN="1", **env)
    assert res.returncode == 0, f"dry run failed ({res.returncode}):\n{res.stderr}\n{res.stdout}"
    return Plan(res.stdout)


def fail(platform: str, *args: str, **env: str) -> str:
    res = run(platform, *args, **env)
    assert res.returncode != 0, f"expected a failure, got:\n{res.stdout}"
    assert res.stderr.strip().startswith("error:"), res.stderr
    return res.stderr


# ------------------------------------------------------------------ Frontier


@pytest.mark.parametrize("nodes", [1, 2, 16])
def test_frontier_task_count(nodes: int) -> None:
    plan = dry("frontier", NODES=str(nodes))
    flags = plan.srun_flags
    assert f"-N{nodes}" in flags and f"-n{8 * nodes}" in flags
    assert "--ntasks-per-node=8" in flags
    assert "-c7" in flags and "--gpus-per-task=1" in flags and "--gpu-bind=closest" in flags
    assert "--distribution=block" in flags and "--kill-on-bad-exit=1" in flags


def test_frontier_plan_loads_rocm_binds_one_gcd_per_task_and_sets_rccl_over_slingshot() -> None:
    plan = dry("frontier", NODES="2", AWS_OFI_RCCL_DIR="/sw/aws-ofi-rccl", LD_LIBRARY_PATH="/opt/rocm/lib")
    env = plan.env
    assert plan.modules == ["PrgEnv-gnu", "rocm/6.2.4", "craype-accel-amd-gfx90a"]
    assert env["NCCL_SOCKET_IFNAME"] == "hsn0"
    assert env["LD_LIBRARY_PATH"] == "/sw/aws-ofi-rccl/lib:/opt/rocm/lib"
    assert env["AWS_OFI_RCCL_DIR"] == "/sw/aws-ofi-rccl"
    for name in ("FI_MR_CACHE_MONITOR", "FI_CXI_DEFAULT_CQ_SIZE", "NCCL_NET_GDR_LEVEL", "NCCL_CROSS_NIC"):
        assert env[name], name
    assert env["MIOPEN_USER_DB_PATH"].startswith("/tmp/")
    assert env["MIOPEN_CUSTOM_CACHE_DIR"] == env["MIOPEN_USER_DB_PATH"]
    # One visible GCD per task: device 0; the topology keeps SLURM_LOCALID.
    assert env["LAUNCH_LOCAL_RANK"] == "zero"
    assert "LOCAL_RANK=0 " in plan.text
    assert env["MASTER_ADDR"] and env["MASTER_PORT"] == "3442"


def test_frontier_preset_and_config() -> None:
    plan = dry("frontier", NODES="2")
    assert "python" in Path(plan.job[0]).name and plan.job[1] == "-u"
    assert plan.job[2] == str(ROOT / "scripts" / "pretrain_gpt.py")
    assert plan.job_flag("--num-layers") == "44"
    assert plan.job_flag("--hidden-size") == "6144"
    assert plan.job_flag("--num-attention-heads") == "64"
    assert plan.job_flag("--seq-length") == "2048"
    assert "--bf16" in plan.job
    assert plan.job_flag("--deepspeed-config") == str(PRESETS / "ds_frontier_20b.json")


def test_frontier_respects_caller_settings() -> None:
    plan = dry(
        "frontier",
        NODES="1",
        NCCL_SOCKET_IFNAME="hsn0,hsn1",
        MASTER_PORT="4000",
        MASTER_ADDR="10.0.0.1",
        MODULES="PrgEnv-cray rocm/6.2.4",
    )
    assert plan.env["NCCL_SOCKET_IFNAME"] == "hsn0,hsn1"
    assert plan.env["MASTER_PORT"] == "4000" and plan.env["MASTER_ADDR"] == "10.0.0.1"
    assert plan.modules == ["PrgEnv-cray", "rocm/6.2.4"]


def test_empty_value_drops_a_default() -> None:
    plan = dry("frontier", NODES="1", NCCL_NET_GDR_LEVEL="")
    assert "NCCL_NET_GDR_LEVEL" not in plan.env and plan.env["NCCL_CROSS_NIC"] == "1"


def test_frontier_inside_allocation(tmp_path: Path) -> None:
    """In a job: NODES defaults to the allocation, MASTER_ADDR is the first node, MIOpen path per job."""
    fake = tmp_path / "bin"
    fake.mkdir()
    scontrol = fake / "scontrol"
    scontrol.write_text(
        '#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "frontier00042\\nfrontier00043\\n"\n'
    )
    scontrol.chmod(0o755)
    env = clean_env(
        DRY_RUN="1",
        PATH=f"{fake}:{os.environ['PATH']}",
        SLURM_JOB_ID="1234",
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_NODELIST="frontier[00042-00043]",
        USER="alice",
    )
    res = run("frontier", env=env)
    assert res.returncode == 0, res.stderr
    plan = Plan(res.stdout)
    assert "-N2" in plan.srun_flags and "-n16" in plan.srun_flags
    assert plan.env["MASTER_ADDR"] == "frontier00042"
    assert plan.env["MIOPEN_USER_DB_PATH"] == "/tmp/alice-miopen-1234"
    # Asking for more nodes than the allocation has is an error that names the fix.
    env["NODES"] = "4"
    res = run("frontier", env=env)
    assert res.returncode != 0 and "sbatch -N 4" in res.stderr


def test_dry_run_flag_equals_env() -> None:
    by_env = run("frontier", DRY_RUN="1", NODES="2").stdout
    by_flag = run("frontier", "--dry-run", "--nodes", "2").stdout
    assert by_env == by_flag and "# DRY RUN" in by_flag


# ------------------------------------------------------------------ NVIDIA


def test_nvidia_default_all_gpus_visible() -> None:
    plan = dry("nvidia", NODES="2")
    flags = plan.srun_flags
    assert "-N2" in flags and "-n16" in flags and "--ntasks-per-node=8" in flags
    assert "--gpus-per-node=8" in flags
    assert plan.env["LAUNCH_LOCAL_RANK"] == "slurm"
    assert "LOCAL_RANK=$SLURM_LOCALID" in plan.text
    assert plan.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert plan.env["MASTER_ADDR"] and plan.env["MASTER_PORT"] == "29500"
    assert plan.job_flag("--num-layers") == "24" and plan.job_flag("--hidden-size") == "2048"
    assert plan.job_flag("--deepspeed-config") == str(PRESETS / "ds_nvidia_bf16.json")


def test_nvidia_one_gpu_per_task() -> None:
    plan = dry("nvidia", NODES="3", GPUS_PER_NODE="4", GPU_BINDING="task", NCCL_SOCKET_IFNAME="ib0")
    flags = plan.srun_flags
    assert "-N3" in flags and "-n12" in flags and "--ntasks-per-node=4" in flags
    assert "--gpus-per-task=1" in flags
    assert plan.env["LAUNCH_LOCAL_RANK"] == "zero" and "LOCAL_RANK=0 " in plan.text
    assert plan.env["NCCL_SOCKET_IFNAME"] == "ib0"


# ------------------------------------------------------------------ local


def test_local_plan_runs_4_cpu_ranks_on_one_node_with_the_cpu_preset() -> None:
    plan = dry("local")
    flags = plan.srun_flags
    assert "-N1" in flags and "-n4" in flags
    assert plan.env["CUDA_VISIBLE_DEVICES"] == ""
    assert plan.env["MASTER_ADDR"] == "127.0.0.1"
    assert plan.job_flag("--deepspeed-config") == str(PRESETS / "ds_cpu_local.json")
    assert plan.job_flag("--hidden-size") == "64"


def _fake_upstream(root: Path, kind: str) -> Path:
    """A directory with the layout of an upstream checkout (what the launcher looks at)."""
    marker = {"megatron-lm": "megatron/training/initialize.py", "megatron-deepspeed": "megatron/training.py"}[
        kind
    ]
    (root / marker).parent.mkdir(parents=True, exist_ok=True)
    (root / marker).touch()
    (root / "pretrain_gpt.py").touch()
    return root


@pytest.mark.parametrize(
    ("kind", "config_flag"), [("megatron-lm", None), ("megatron-deepspeed", "--deepspeed_config")]
)
def test_local_upstream_runs_through_the_launcher(tmp_path: Path, kind: str, config_flag: str | None) -> None:
    tree = _fake_upstream(tmp_path / kind, kind)
    plan = dry("local", UPSTREAM_DIR=str(tree), DATA_PATH="corpus")
    assert plan.job[plan.job.index("-m") : plan.job.index("-m") + 3] == [
        "-m",
        "megatron_ext.launch",
        str(tree / "pretrain_gpt.py"),
    ]
    assert plan.env["PYTHONPATH"].split(":")[0] == str(ROOT)
    assert plan.job_flag("--data-path") == "corpus"
    preset = PRESETS / "upstream" / f"{kind}-local"
    assert plan.job_flag("--num-layers") == "2" and f"model preset: {preset}.args" in plan.text
    if config_flag is None:  # Megatron-LM trains without DeepSpeed: no JSON unless CONFIG is set
        assert "--deepspeed-config" not in plan.job and "--deepspeed_config" not in plan.job
    else:  # DeepSpeed's own flag: Megatron-DeepSpeed reads it patched or not
        assert plan.job_flag(config_flag) == f"{preset}.json"


@pytest.mark.parametrize(
    ("upstream", "env", "needle"),
    [
        ("none", {"DATA_PATH": "corpus"}, "holds no pretrain_gpt.py"),
        ("bare", {"DATA_PATH": "corpus"}, "is neither Megatron-LM"),
        ("megatron-lm", {}, "set DATA_PATH"),
    ],
)
def test_local_upstream_bad_input(tmp_path: Path, upstream: str, env: dict, needle: str) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    if upstream == "bare":
        (tree / "pretrain_gpt.py").touch()
    elif upstream != "none":
        _fake_upstream(tree, upstream)
    assert needle in fail("local", UPSTREAM_DIR=str(tree), DRY_RUN="1", **env)


def test_local_tasks_follow_allocation() -> None:
    plan = dry("local", SLURM_JOB_NUM_NODES="1", SLURM_NTASKS="2", SLURM_JOB_ID="77")
    assert "-n2" in plan.srun_flags
    assert plan.env["MASTER_PORT"] == str(20000 + 77)


def test_parameters_reach_the_job(tmp_path: Path) -> None:
    cfg = tmp_path / "my.json"
    cfg.write_text("{}")
    plan = dry(
        "local",
        "--train-iters",
        "7",
        "--",
        "--log-interval",
        "3",
        MODEL="gpt-1.3b",
        CONFIG=str(cfg),
        DATA_PATH=str(tmp_path / "corpus"),
        CHECKPOINT_DIR=str(tmp_path / "ckpt"),
        EXTRA_ARGS="--lr 5e-4 --seq-length 128",
    )
    assert plan.job_flag("--hidden-size") == "2048"  # the gpt-1.3b preset
    assert plan.job_flag("--deepspeed-config") == str(cfg)
    assert plan.job_flag("--data-path") == str(tmp_path / "corpus")
    assert plan.job_flag("--save") == plan.job_flag("--load") == str(tmp_path / "ckpt")
    # EXTRA_ARGS and command-line flags come after the preset, so they win.
    assert plan.job_flag("--lr") == "5e-4" and plan.job_flag("--seq-length") == "128"
    assert plan.job_flag("--train-iters") == "7" and plan.job_flag("--log-interval") == "3"


def test_config_by_preset_name() -> None:
    plan = dry("local", CONFIG="ds_frontier_20b")
    assert plan.job_flag("--deepspeed-config") == str(PRESETS / "ds_frontier_20b.json")


# ------------------------------------------------------------------ bad parameters


@pytest.mark.parametrize("platform", PLATFORMS)
def test_unknown_preset(platform: str) -> None:
    err = fail(platform, DRY_RUN="1", MODEL="gpt-7t")
    assert "unknown model preset MODEL='gpt-7t'" in err
    assert "tiny-cpu" in err and "gpt-20b-frontier" in err  # lists the choices


@pytest.mark.parametrize("nodes", ["0", "-2", "two", "1.5", " "])
@pytest.mark.parametrize("platform", PLATFORMS)
def test_nodes_not_positive_integer(platform: str, nodes: str) -> None:
    err = fail(platform, DRY_RUN="1", NODES=nodes)
    assert "is not a positive integer" in err and "NODES=" in err


def test_nodes_option_checked_too() -> None:
    assert "not a positive integer" in fail("frontier", "--dry-run", "--nodes", "x")
    assert "needs a value" in fail("frontier", "--dry-run", "--nodes")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_missing_config(platform: str) -> None:
    err = fail(platform, DRY_RUN="1", CONFIG="/no/such/ds.json")
    assert "CONFIG='/no/such/ds.json' not found" in err and "JSON" in err


def test_invalid_json_config(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {"stage": 3,}}')
    assert "is not valid JSON" in fail("local", DRY_RUN="1", CONFIG=str(bad))


def test_tensor_parallel_must_divide_tasks() -> None:
    err = fail("local", DRY_RUN="1", TASKS_PER_NODE="3")
    assert "tensor-parallel groups of 2" in err


def test_an_invalid_setting_is_refused_naming_its_variable() -> None:
    assert "GPU_BINDING" in fail("nvidia", DRY_RUN="1", GPU_BINDING="socket")
    assert "GPUS_PER_NODE" in fail("nvidia", DRY_RUN="1", GPUS_PER_NODE="eight")
    assert "DRY_RUN" in fail("local", DRY_RUN="maybe")
    assert "MASTER_PORT" in fail("local", DRY_RUN="1", MASTER_PORT="70000")


def test_real_launch_needs_an_allocation() -> None:
    err = fail("local", DRY_RUN="0")
    assert "DRY_RUN=1" in err


# ------------------------------------------------------------------ per-rank wrapper


def rank_env(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SLURM_DIR / "rank_env.sh"), "env"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env=clean_env(**env),
    )


@pytest.mark.parametrize(("mode", "local_rank"), [("zero", "0"), ("slurm", "5")])
def test_rank_wrapper_exports_the_torch_rank_variables_from_slurms(
    tmp_path: Path, mode: str, local_rank: str
) -> None:
    miopen = tmp_path / "miopen"
    res = rank_env(
        tmp_path,
        SLURM_PROCID="13",
        SLURM_NTASKS="16",
        SLURM_LOCALID="5",
        SLURM_NODEID="1",
        SLURM_NTASKS_PER_NODE="8",
        LAUNCH_LOCAL_RANK=mode,
        MIOPEN_USER_DB_PATH=str(miopen),
    )
    assert res.returncode == 0, res.stderr
    env = dict(line.split("=", 1) for line in res.stdout.splitlines() if "=" in line)
    assert env["RANK"] == "13" and env["WORLD_SIZE"] == "16" and env["LOCAL_WORLD_SIZE"] == "8"
    assert env["LOCAL_RANK"] == local_rank
    assert env["SLURM_LOCALID"] == "5" and env["SLURM_NODEID"] == "1"
    assert miopen.is_dir()


def test_rank_env_outside_srun(tmp_path: Path) -> None:
    res = rank_env(tmp_path)
    assert res.returncode != 0 and "must run under srun" in res.stderr


# ------------------------------------------------------------------ presets


def read_args(path: Path) -> list[str]:
    words: list[str] = []
    for line in path.read_text().splitlines():
        words += line.split("#", 1)[0].split()
    return words


def as_dict(words: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for i, w in enumerate(words):
        if w.startswith("--"):
            nxt = words[i + 1] if i + 1 < len(words) else None
            out[w] = None if nxt is None or nxt.startswith("--") else nxt
    return out


PAIRS = [
    ("tiny-cpu", "ds_cpu_local.json"),
    ("gpt-1.3b", "ds_nvidia_bf16.json"),
    ("gpt-20b-frontier", "ds_frontier_20b.json"),
]


@pytest.mark.parametrize("preset", sorted(p.stem for p in PRESETS.glob("*.args")))
def test_preset_flags_are_job_flags(preset: str) -> None:
    flags = as_dict(read_args(PRESETS / f"{preset}.args"))
    unknown = set(flags) - JOB_FLAGS
    assert not unknown, f"{preset}.args uses flags the job does not take: {sorted(unknown)}"
    heads, tp = int(flags["--num-attention-heads"]), int(flags["--tensor-model-parallel-size"] or 1)
    assert int(flags["--hidden-size"]) % heads == 0 and heads % tp == 0
    assert int(flags["--seq-length"]) % tp == 0  # sequence parallelism (Flash-Overlap) splits it


def test_frontier_20b_preset_has_the_20b_gpt_shape() -> None:
    flags = as_dict(read_args(PRESETS / "gpt-20b-frontier.args"))
    assert (flags["--num-layers"], flags["--hidden-size"], flags["--num-attention-heads"]) == (
        "44",
        "6144",
        "64",
    )
    assert flags["--seq-length"] == "2048" and "--bf16" in flags


@pytest.mark.parametrize(("preset", "config"), PAIRS)
def test_preset_matches_config(preset: str, config: str) -> None:
    flags = as_dict(read_args(PRESETS / f"{preset}.args"))
    cfg = json.loads((PRESETS / config).read_text())
    assert cfg["train_micro_batch_size_per_gpu"] == int(flags["--micro-batch-size"])
    assert cfg.get("gradient_accumulation_steps", 1) == 1  # the job derives the global batch as micro x DP
    assert "train_batch_size" not in cfg  # depends on the node count
    assert cfg["optimizer"]["params"]["lr"] == float(flags["--lr"])
    assert cfg.get("bf16", {}).get("enabled", False) == ("--bf16" in flags)
    assert cfg["zero_optimization"]["stage"] == 3
    for section in ("shm_data_loader", "flash_overlap", "hierarchical_zero"):
        assert cfg[section]["enabled"] is True, f"{config}: {section} not enabled"


def test_cpu_config_uses_torch_adam_fp32() -> None:
    cfg = json.loads((PRESETS / "ds_cpu_local.json").read_text())
    assert cfg["optimizer"]["type"] == "Adam" and cfg["optimizer"]["params"]["torch_adam"] is True
    assert not cfg.get("bf16", {}).get("enabled") and not cfg.get("fp16", {}).get("enabled")


@pytest.mark.parametrize("config", sorted(p.name for p in PRESETS.glob("ds_*.json")))
def test_config_plugin_sections_validate(config: str) -> None:
    from megatron_ext.integration.plugin_config import load_plugin_config

    plugins = load_plugin_config(str(PRESETS / config))
    assert (
        plugins.hierarchical_zero.enabled
        and plugins.flash_overlap.enabled
        and plugins.shm_data_loader.enabled
    )


# ------------------------------------------------------------------ hygiene


@pytest.mark.parametrize(
    "script",
    [*sorted(SLURM_DIR.glob("*.sbatch")), *sorted(SLURM_DIR.glob("*.sh")), ROOT / ".ci" / "slurm_cluster.sh"],
    ids=lambda p: p.name,
)
def test_shell_syntax_and_strict_mode(script: Path) -> None:
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30, check=False)
    assert res.returncode == 0, res.stderr
    if script.name not in ("common.sh", "job_checks.sh"):  # sourced: inherits the caller's strict mode
        assert "set -euo pipefail" in script.read_text()


def test_cluster_script_usage() -> None:
    res = subprocess.run(
        ["bash", str(ROOT / ".ci" / "slurm_cluster.sh"), "bogus"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert res.returncode == 2 and "start|stop|status" in res.stderr


def test_the_dry_run_warns_when_no_data_path_is_given():
    for platform in PLATFORMS:
        proc = run(platform, DRY_RUN="1")
        assert proc.returncode == 0, proc.stderr
        assert "warning: no DATA_PATH: the job would train on a small generated corpus" in proc.stderr
    given = run("nvidia", DRY_RUN="1", DATA_PATH=str(ROOT / "corpus"))
    assert "no DATA_PATH" not in given.stderr


def test_account_and_partition_show_in_the_dry_run_and_reach_srun():
    proc = run("frontier", DRY_RUN="1", NODES="2", ACCOUNT="abc123", PARTITION="batch")
    assert proc.returncode == 0, proc.stderr
    plan = Plan(proc.stdout)
    assert "# submit: sbatch -A abc123 -p batch -N 2 scripts/slurm/frontier.sbatch" in plan.text
    assert {"--account=abc123", "--partition=batch"} <= set(plan.srun_flags)
    bare = Plan(run("frontier", DRY_RUN="1").stdout)
    assert "# account: (from the allocation)  partition: (from the allocation)" in bare.text
    assert not [f for f in bare.srun_flags if f.startswith(("--account", "--partition"))]


def test_containers_pyxis_or_apptainer_wrap_every_rank():
    pyxis = Plan(run("nvidia", DRY_RUN="1", CONTAINER_IMAGE="nvcr.io/nvidia/pytorch:25.01-py3").stdout)
    assert "# container (pyxis): nvcr.io/nvidia/pytorch:25.01-py3" in pyxis.text
    assert "--container-image=nvcr.io/nvidia/pytorch:25.01-py3" in pyxis.srun_flags
    assert f"--container-mounts={ROOT}:{ROOT}" in pyxis.srun_flags
    apptainer = Plan(run("frontier", DRY_RUN="1", APPTAINER_IMAGE="/images/rocm.sif").stdout)
    assert "# container (apptainer): /images/rocm.sif" in apptainer.text
    assert apptainer.srun_flags[-6:] == [
        "apptainer",
        "exec",
        "--rocm",
        "--bind",
        str(ROOT),
        "/images/rocm.sif",
    ]
    both = run("local", DRY_RUN="1", CONTAINER_IMAGE="a", APPTAINER_IMAGE="b")
    assert both.returncode == 2 and "choose one container runtime" in both.stderr


def test_nvidia_ranks_get_their_share_of_the_nodes_cores():
    assert "--cpus-per-task=8" in Plan(run("nvidia", DRY_RUN="1").stdout).srun_flags
    shared = Plan(run("nvidia", DRY_RUN="1", SLURM_CPUS_ON_NODE="96").stdout)
    assert "--cpus-per-task=12" in shared.srun_flags  # 96 cores over 8 ranks
    assert "--cpus-per-task=6" in Plan(run("nvidia", DRY_RUN="1", CPUS_PER_TASK="6").stdout).srun_flags
    bad = run("nvidia", DRY_RUN="1", CPUS_PER_TASK="many")
    assert bad.returncode == 2 and "CPUS_PER_TASK='many' is not a positive integer" in bad.stderr


def test_frontier_loads_a_named_rocm_version():
    assert "rocm/6.2.4" in Plan(run("frontier", DRY_RUN="1").stdout).modules
    assert "rocm/6.3.1" in Plan(run("frontier", DRY_RUN="1", ROCM_VERSION="6.3.1").stdout).modules
