"""Every process-wide change has one owner: the table in docs/architecture.md lists exactly the changes the main
job's installer records (all three plugins on) and the upstream launcher's, and closing the
installer undoes them: no process group, no CPU patch, DeepSpeed's own functions back, no hop or
poster thread, no loader process."""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path

from mdsp_base.installer import Installer

ROOT = Path(__file__).resolve().parents[3]
EVENTS: list[list[tuple[str, str]]] = []


def documented_rows() -> set[tuple[str, str]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## Process-wide changes") :]
    section = section.split("\n## ")[0]
    return {(m[1], m[2].strip()) for m in re.finditer(r"^\| `([^`]+)` \| (.+?) \| [^|]+ \|$", section, re.M)}


def _children() -> set[int]:
    """Live child processes of this process."""
    return {
        int(pid)
        for task in Path("/proc/self/task").iterdir()
        for pid in (task / "children").read_text().split()
    }


def test_the_main_job_records_the_documented_rows_and_undoes_them(lone_rank, capsys):
    import json

    import torch.distributed as dist
    from deepspeed.runtime.zero import partition_parameters, stage3
    from megatron.core import parallel_state as ps

    from megatron_ext.integration.core_on_cpu import cpu_support_enabled
    from megatron_ext.trainer import main as job
    from megatron_ext.trainer.cli import parse_args
    from megatron_ext.trainer.notices import quiet

    (lone_rank / "ds.json").write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 3},
                "optimizer": {"type": "Adam", "params": {"torch_adam": True}},
                "hierarchical_zero": {"enabled": True},
                "shm_data_loader": {"enabled": True},
                "flash_overlap": {"enabled": True},
            }
        )
    )
    args = parse_args(
        "--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --train-iters 1 "
        f"--deepspeed-config ds.json --data-cache-path {lone_rank / 'data'} "
        f"--tensorboard-dir {lone_rank / 'tensorboard'}".split()
    )
    stock = (partition_parameters._dist_allgather_fn, stage3.reduce_scatter_coalesced)
    before = _children()
    with Installer() as installer:
        job.train(args, installer, quiet(installer))
        recorded = {(c.owner, c.what) for c in installer.changes}
        started = _children() - before
    assert recorded <= documented_rows(), sorted(recorded - documented_rows())
    assert {owner for owner, _ in recorded} >= {
        "deepspeed_ext.zero",
        "megatron_ext.data",
        "megatron_ext.layers",
    }
    assert not dist.is_initialized() and not ps.model_parallel_is_initialized() and not cpu_support_enabled()
    assert (partition_parameters._dist_allgather_fn, stage3.reduce_scatter_coalesced) == stock
    assert not [
        t.name for t in threading.enumerate() if t.name.startswith(("hierarchical-zero", "flash-overlap"))
    ]
    assert started, "the loader started no producer: the check below would see nothing"
    assert not started & _children(), "the loader's producer outlived the job"
    # Megatron's --tensorboard-dir: the iteration's figures as scalars, the writer closed by the installer.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(lone_rank / "tensorboard"))
    events.Reload()
    assert {"loss", "lr", "ms_per_iter", "consumed_samples", "memory_gb"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("loss")] == [1]
    # A plugin with nothing to do here (Flash-Overlap at TP=1, hierarchical ZeRO at DP=1) says so once.
    err = capsys.readouterr().err
    assert err.count("warning: flash_overlap is on at --tensor-model-parallel-size 1") == 1
    assert err.count("warning: hierarchical_zero is on with one data-parallel rank") == 1


def test_the_launcher_and_its_hooks_record_the_documented_rows(tmp_path):
    from megatron_ext.integration import launch

    tree = tmp_path / "mds"
    (tree / "megatron").mkdir(parents=True)
    (tree / "megatron" / "training.py").touch()
    script = tree / "pretrain_gpt.py"
    script.write_text(
        "from tests.megatron_ext.integration import test_process_changes\n"
        "from megatron_ext.integration.upstream import hooks\n"
        "test_process_changes.EVENTS.append([(c.owner, c.what) for c in hooks.installer().changes])\n"
    )
    EVENTS.clear()
    launch.run(str(script), [])
    (recorded,) = EVENTS
    assert set(recorded) <= documented_rows(), sorted(set(recorded) - documented_rows())
    assert sys.argv[0] != str(script)
