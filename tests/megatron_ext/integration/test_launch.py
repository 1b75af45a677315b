"""``python -m megatron_ext.launch``: the variables it adds for torchrun and srun, the trees it
accepts, the stand-in modules, and the CPU mapping of upstream Megatron-LM's CUDA assumptions, each
undone after the script. The end-to-end runs of both upstream trees are in test_upstream_training.py."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from megatron_ext.integration import launch
from megatron_ext.integration.upstream import scripts_on_cpu as cpu_upstream
from megatron_ext.integration.upstream import standins

ROOT = Path(__file__).resolve().parents[3]


def test_torchrun_gets_local_size_from_local_world_size() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "n0"}
    added = launch.launch_env(env)
    assert added["LOCAL_SIZE"] == "4"
    assert not set(added) & set(env), "a variable torchrun set was changed"


def test_srun_gets_torch_variables_from_slurm_and_keeps_what_is_set() -> None:
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
        "MASTER_ADDR": "n0",
        "LOCAL_RANK": "0",
    }  # one GPU visible per task: the user's LOCAL_RANK stays
    added = launch.launch_env(env)
    assert {k: added[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE")} == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "LOCAL_SIZE": "4",
    }
    assert "LOCAL_RANK" not in added


def test_one_process_needs_no_rendezvous() -> None:
    assert launch.launch_env({})["LOCAL_SIZE"] == "1"


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"WORLD_SIZE": "4", "RANK": "0", "MASTER_ADDR": "n0"}, "LOCAL_SIZE=<ranks per node>"),
        ({"WORLD_SIZE": "4", "RANK": "0", "LOCAL_WORLD_SIZE": "4"}, "MASTER_ADDR"),
    ],
)
def test_missing_rendezvous_facts_are_named(env: dict, needle: str) -> None:
    with pytest.raises(launch.LaunchError, match=needle):
        launch.launch_env(env)


def test_this_interpreter_comes_first_on_path() -> None:
    path = launch.launch_env({"PATH": "/usr/bin"})["PATH"].split(os.pathsep)
    assert path[0] == os.path.dirname(sys.executable) and path[-1] == "/usr/bin"


def test_upstream_tree_is_recognised_by_its_layout(tmp_path: Path) -> None:
    lm, mds, other = tmp_path / "lm", tmp_path / "mds", tmp_path / "other"
    (lm / "megatron" / "training").mkdir(parents=True)
    (lm / "megatron" / "training" / "initialize.py").touch()
    (mds / "megatron").mkdir(parents=True)
    (mds / "megatron" / "training.py").touch()
    other.mkdir()
    assert launch.upstream_kind(str(lm / "pretrain_gpt.py")) == launch.MEGATRON_LM
    assert launch.upstream_kind(str(mds / "pretrain_gpt.py")) == launch.MEGATRON_DEEPSPEED
    with pytest.raises(launch.LaunchError, match="not in the root of a Megatron-LM or Megatron-DeepSpeed"):
        launch.upstream_kind(str(other / "pretrain_gpt.py"))


SCRIPT_ENDINGS = {"returns": "", "exits 0": "sys.exit(0)", "raises": "raise RuntimeError('boom')"}


def test_process_groups_a_script_leaves_are_destroyed_when_it_ends_normally(tmp_path: Path) -> None:
    """Upstream's pretrain never destroys its groups; a normal end must not leave them to the
    interpreter's finalization. A failing script keeps them (its peers may still be in a collective)."""
    tree = tmp_path / "mds"
    (tree / "megatron").mkdir(parents=True)
    (tree / "megatron" / "training.py").touch()
    runs = {}
    for ending, line in SCRIPT_ENDINGS.items():
        script = tree / f"pretrain_{ending.replace(' ', '_')}.py"
        script.write_text(
            "import atexit, sys\n"
            "import torch.distributed as dist\n"
            "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
            "atexit.register(lambda: print('groups at exit:', dist.is_initialized(), flush=True))\n"
            f"{line}\n"
        )
        runs[ending] = subprocess.Popen(
            [sys.executable, "-m", "megatron_ext.launch", str(script)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    ends = {ending: run.communicate(timeout=120)[0] for ending, run in runs.items()}
    assert "groups at exit: False" in ends["returns"], ends["returns"]
    assert "groups at exit: False" in ends["exits 0"], ends["exits 0"]
    assert "groups at exit: True" in ends["raises"] and "RuntimeError: boom" in ends["raises"], ends["raises"]


def test_bad_script_is_one_error_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "megatron_ext.launch", str(tmp_path / "missing.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: {str(tmp_path / 'missing.py')!r} is not a Python file: "
        "pass the path of the upstream pretrain_gpt.py"
    ]


def test_standins_import_but_fail_loudly_when_used_and_go_away() -> None:
    name = "megatron_ext_absent_pkg"
    assert standins.install({name: "never used by GPT training"}) == [name]
    try:
        import megatron_ext_absent_pkg.sub as sub  # type: ignore[import-not-found]

        class Subclass(sub.Dataset):  # defining a subclass at import time works, as upstream does
            pass

        with pytest.raises(
            standins.StandInError, match=f"{name}.sub.Dataset was called.*install the real package"
        ):
            Subclass()
        with pytest.raises(standins.StandInError):
            sub.transform(1)
    finally:
        standins.uninstall()
    assert name not in sys.modules and not any(isinstance(f, standins._Finder) for f in sys.meta_path)
    with pytest.raises(ModuleNotFoundError):
        __import__(name)


def test_standins_never_shadow_an_installed_module() -> None:
    assert standins.install({"json": "installed"}) == []
    import json

    assert not isinstance(json, standins.StandInModule)


def test_cpu_mapping_is_inert_where_cuda_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = {name: getattr(torch.cuda, name) for name in ("device_count", "synchronize", "get_rng_state")}
    assert cpu_upstream.enable() is False
    assert not cpu_upstream.enabled()
    assert {name: getattr(torch.cuda, name) for name in before} == before


def _fake_megatron_lm() -> dict[str, types.SimpleNamespace]:
    def initialize_megatron(**kwargs: object) -> dict:
        return kwargs

    def arch() -> int:
        raise AssertionError("the real one asks the GPU")

    modules = {
        key: types.SimpleNamespace()
        for key in ("fused_kernels", "training_pkg", "arguments", "initialize", "training", "utils")
    }
    modules["fused_kernels"].load = lambda args: (_ for _ in ()).throw(AssertionError("nvcc"))
    for key in ("utils", "arguments"):
        modules[key].get_device_arch_version = arch
    for key in ("initialize", "training_pkg", "training"):
        modules[key].initialize_megatron = initialize_megatron
    return modules


def test_cpu_mapping_runs_cuda_calls_on_cpu_and_is_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    modules = _fake_megatron_lm()
    monkeypatch.setattr(cpu_upstream, "_megatron_lm_modules", lambda: modules)
    for name in cpu_upstream.ENV_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    names = ("device_count", "set_device", "synchronize", "Stream", "Event", "get_rng_state", "set_rng_state")
    before = {name: getattr(torch.cuda, name) for name in names}
    originals = {key: vars(m).copy() for key, m in modules.items()}
    assert cpu_upstream.enable() is True
    try:
        assert torch.cuda.device_count() == 1
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert (
            torch.ones(1).cuda().type() == "torch.cuda.FloatTensor"
        )  # upstream's clip_grads asserts this name
        assert modules["initialize"].initialize_megatron(x=1) == {"x": 1, "allow_no_cuda": True}
        assert modules["utils"].get_device_arch_version() == 0
        modules["fused_kernels"].load(None)  # loads nothing, compiles nothing
        assert os.environ["TORCH_COMPILE_DISABLE"] == "1" and os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    finally:
        cpu_upstream.disable()
    assert not cpu_upstream.enabled()
    assert {name: getattr(torch.cuda, name) for name in names} == before
    assert {key: vars(m) for key, m in modules.items()} == originals
    assert all(name not in os.environ for name in cpu_upstream.ENV_DEFAULTS)
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")  # the mode is gone: no CUDA here


EVENTS: list[tuple[str, str | None]] = []


def test_the_hooks_changes_are_undone_first_then_the_launchers(tmp_path: Path) -> None:
    """A hook's change (as the upstream hooks register engines, loaders and threads) goes through
    the launcher's installer: undone when the script ends, while the launcher's own changes (here
    its LOCAL_SIZE) still hold, and those after it; outside a run the hooks have no owner."""
    from megatron_ext.integration.upstream import hooks

    tree = tmp_path / "mds"
    (tree / "megatron").mkdir(parents=True)
    (tree / "megatron" / "training.py").touch()
    script = tree / "pretrain_gpt.py"
    script.write_text(
        "import os\n"
        "from tests.megatron_ext.integration import test_launch\n"
        "from megatron_ext.integration.upstream import hooks\n"
        "hooks.installer().add('test', 'a hook', lambda: test_launch.EVENTS.append(('undone', os.environ.get('LOCAL_SIZE'))))\n"
        "test_launch.EVENTS.append(('ran', os.environ.get('LOCAL_SIZE')))\n"
    )
    before_env, before_path = dict(os.environ), list(sys.path)
    EVENTS.clear()
    launch.run(str(script), [])
    assert EVENTS == [("ran", "1"), ("undone", "1")]
    assert dict(os.environ) == before_env and sys.path == before_path
    with pytest.raises(RuntimeError, match="python -m megatron_ext.launch"):
        hooks.installer()
