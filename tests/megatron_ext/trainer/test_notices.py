"""What the main job prints besides its iteration lines: each notice once per job, third-party
warnings filtered to those a user can act on (with the count of the rest), megatron-core's dataset
config not as one huge line, DeepSpeed's unused CPU comm op not built, and nothing left in the
temporary directory."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from multirank import free_port
from multirank.warm import WarmLauncher
from tests.helpers.main_job import SCRIPT, SMALL, job_env


@pytest.mark.slow
def test_two_ranks_print_each_notice_once_and_no_library_warnings(tmp_path: Path) -> None:
    """Launched cold by torchrun, as a user launches it: the import-time warnings are the job's."""
    extensions = tmp_path / "torch_extensions"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", SCRIPT]
    cmd += [*SMALL, "--data-cache-path", str(tmp_path / "data"), "--train-iters", "2"]
    cmd += ["--tensor-model-parallel-size", "2", "--flash-overlap"]
    env = job_env(TORCH_EXTENSIONS_DIR=str(extensions))
    env.pop("PYTHONWARNINGS", None)
    shm_before = set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    # megatron-core's "Transformer Engine and Apex are not installed" (several per rank), DeepSpeed's
    # "Setting accelerator to CPU": none a CPU run can act on; counted once, by rank 0
    assert "UserWarning" not in out and "warnings.warn(" not in out and "Setting accelerator" not in out, out
    hidden = [line for line in out.splitlines() if "third-party warnings hidden on rank 0" in line]
    assert len(hidden) == 1 and int(hidden[0].split()[0]) > 0, out
    # the plugin's notice once, not once per rank; no op build or its line; no per-rank shm buffer
    assert out.count("Flash-Overlap backend: p2p") == 1, out
    assert "built successfully" not in out and not list(extensions.glob("*/deepspeed_shm_comm*")), out
    assert set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")) == shm_before
    # megatron-core's dataset line without its config's repr
    assert "Building GPTDataset splits with sizes=" in out and "GPTDatasetConfig(" not in out, out
    assert len([line for line in out.splitlines() if "] iteration " in line]) == 2, out  # rank 0's


def test_an_error_from_every_rank_is_printed_once(main_job_warm: WarmLauncher, tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    argv = [SCRIPT, *SMALL, "--shm-data-loader", "--shm-data-loader-dir", str(tmp_path / "nonexistent")]
    assert main_job_warm.launch(argv, tmp_path, log, 1, 2, free_port(), 120) == [2, 2]
    errors = [line for line in log.read_text().splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "is not a directory" in errors[0], errors


def test_a_lone_process_leaves_no_rendezvous_folder(
    pretrain_main: Callable[..., int], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    assert pretrain_main("--train-iters", "1") == 0
    assert list(temp.glob("pretrain-gpt-*")) == []  # (torch's inductor keeps its cache folder there)


def test_an_actionable_warning_is_printed_once_by_rank_zero(capsys: pytest.CaptureFixture[str]) -> None:
    from mdsp_base.installer import Installer
    from megatron_ext.trainer.notices import quiet

    def warn_twice() -> None:
        for _ in range(2):
            warnings.warn("the checkpoint was saved by another version", UserWarning, stacklevel=1)
            warnings.warn("old_flag is deprecated", DeprecationWarning, stacklevel=1)

    with Installer() as installer:
        notices = quiet(installer)
        notices.rank = 0
        warn_twice()  # during start-up: kept until the report
        assert "checkpoint" not in capsys.readouterr().err
        notices.report()
        warnings.warn("a warning after start-up", UserWarning, stacklevel=1)
    captured = capsys.readouterr()
    assert captured.err.count("warning: the checkpoint was saved by another version (UserWarning") == 1
    assert captured.err.count("warning: a warning after start-up (UserWarning") == 1
    assert "deprecated" not in captured.err
    assert "third-party warnings hidden on rank 0" in captured.out
