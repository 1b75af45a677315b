"""The upstream launcher's start-up checks around the script's process group
(``megatron_ext.integration.upstream.startup``), in process: the plugin configuration is checked
only where Megatron's args are set by a parser with the suite's flags, and a transport refusal raised
inside the script's ``init_process_group`` ends the launch as one ``error:`` line, exit status 2, with
the group destroyed and the wrapper gone. (The real trees' refusals: test_upstream_refusals.py.)"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import pytest
import torch.distributed as dist

from mdsp_base.section import ConfigError
from megatron_ext.integration import launch, transport
from megatron_ext.integration.transport import Transport, TransportError, verdict
from megatron_ext.integration.upstream import hooks, startup

SOCKETS = verdict(Transport("Socket", None, ("hsn0",)), True, ["hsn0", "cxi:cxi0"], False)


def _set_args(monkeypatch: pytest.MonkeyPatch, args: argparse.Namespace | None) -> None:
    """Megatron-DeepSpeed's global args as ``initialize_megatron`` leaves them (and none of
    Megatron-LM's, which another test may have imported in this process)."""
    for name, value in zip(startup.GLOBAL_VARS, (None, args)):
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(_GLOBAL_ARGS=value))


def _args(argv: list[str]) -> argparse.Namespace:
    """A Megatron-DeepSpeed job's args at TP=2 without --sequence-parallel, with ``argv``'s plugin flags."""
    args = hooks.with_plugin_args()(argparse.ArgumentParser()).parse_args(argv)
    args.world_size, args.data_parallel_size, args.rank = 2, 1, 0
    args.deepspeed, args.tensor_model_parallel_size, args.sequence_parallel = True, 2, False
    return args


def test_the_plugins_are_checked_once_the_args_are_set(monkeypatch: pytest.MonkeyPatch) -> None:
    _set_args(monkeypatch, None)
    startup.check_plugins()  # before initialize_megatron sets them: nothing to check yet
    unpatched = argparse.Namespace(world_size=2, data_parallel_size=1, flash_overlap=True)
    _set_args(monkeypatch, unpatched)
    startup.check_plugins()  # an unpatched script's parser: it never asks for the plugins
    _set_args(monkeypatch, _args(["--flash-overlap"]))
    with pytest.raises(ConfigError, match="pass --sequence-parallel"):
        startup.check_plugins()


def test_a_transport_refusal_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def sockets() -> None:
        raise TransportError(SOCKETS)

    # as on a GPU node whose NCCL fell back to sockets across nodes (the log's reading: test_transport.py)
    monkeypatch.setattr(transport, "capture_init_log", lambda installer: True)
    monkeypatch.setattr(transport, "check_transport", sockets)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    tree = tmp_path / "mds"
    (tree / "megatron").mkdir(parents=True)
    (tree / "megatron" / "training.py").touch()
    script = tree / "pretrain_gpt.py"
    script.write_text(
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
        "raise AssertionError('the refusal comes first')\n"
    )
    original = dist.init_process_group
    assert launch.main([str(script)]) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [f"error: {SOCKETS}"]
    assert "Traceback" not in err and "undoing" not in err, err
    assert not dist.is_initialized() and dist.init_process_group is original


def test_hierarchical_zero_under_deepspeeds_pipeline_engine_is_refused_at_start_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DeepSpeed's pipeline engine gets no Megatron process groups: the refusal names the flag
    before the model is built, not after."""
    args = _args(["--hierarchical-zero"])
    args.tensor_model_parallel_size, args.data_parallel_size = 1, 2
    args.deepspeed_config_dict = {"zero_optimization": {"stage": 3}}
    _set_args(monkeypatch, args)
    with pytest.raises(ConfigError, match="pass --no-pipeline-parallel"):
        startup.check_plugins()
    args.no_pipeline_parallel = True
    startup.check_plugins()
